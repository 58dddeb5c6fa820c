// Model output as safe HTML: markdown by marked, raw HTML shown as text, the result sanitized by DOMPurify.
// Model output is untrusted: it may hold <script>, event handlers or javascript: links, and none of it may run.
/* global marked, DOMPurify */

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const parser = new marked.Marked({
  gfm: true,
  breaks: true, // a chat's single newlines are line breaks
  renderer: {
    // HTML the model writes (a block or a tag inside a line) is shown as the text it is, never parsed.
    html({ text }) {
      return escapeHtml(text);
    },
  },
});

// Links open in a new tab without handing it this page (window.opener) or the referrer.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

const PURIFY = {
  USE_PROFILES: { html: true },
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe", "object", "embed"],
  FORBID_ATTR: ["style", "id", "name"],
};

/** The markdown `text` as sanitized HTML (a string safe for innerHTML). */
export function renderMarkdown(text) {
  return DOMPurify.sanitize(parser.parse(text), PURIFY);
}
