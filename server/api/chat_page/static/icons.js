// Line icons drawn as inline SVG (no icon font, no emoji font needed), 24x24, in the text's colour.

const PATHS = {
  menu: "M4 6h16M4 12h16M4 18h16",
  settings: "M4 7h9M17 7h3M4 17h3M11 17h9M15 5v4M9 15v4",
  theme: "M12 3a9 9 0 1 0 0 18a9 9 0 1 0 0-18v18",
  rename: "M4 20h4L19 9l-4-4L4 16zM13 7l4 4",
  export: "M12 4v11M7 10l5 5 5-5M5 20h14",
  delete: "M4 7h16M10 7V4h4v3M6 7l1 13h10l1-13M10 11v6M14 11v6",
};
const SVG = "http://www.w3.org/2000/svg";

/** The icon `name` as an <svg> element, hidden from assistive technology (its button has the label). */
export function icon(name) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("class", "svg-icon");
  const path = document.createElementNS(SVG, "path");
  path.setAttribute("d", PATHS[name]);
  svg.append(path);
  return svg;
}

/** Puts the icons into the buttons that name one in data-icon. */
export function placeIcons(root = document) {
  for (const button of root.querySelectorAll("[data-icon]")) button.replaceChildren(icon(button.dataset.icon));
}
