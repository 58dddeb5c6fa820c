"""The browser chat page served at `/`: static files (HTML, JS, CSS, vendored libraries) shipped in the package."""
