// Typeset the pages' math (pymdownx.arithmatex, generic mode) with the KaTeX the package bundles: no CDN.
function oodvizTypeset() {
  document.querySelectorAll(".arithmatex").forEach(function (el) {
    if (el.dataset.typeset) return;
    var tex = el.textContent.trim();
    var display = tex.startsWith("\\[");
    tex = tex.replace(/^\\[\[(]/, "").replace(/\\[\])]$/, "");
    try {
      katex.render(tex, el, { displayMode: display, throwOnError: false });
      el.dataset.typeset = "1";
    } catch (e) { /* left as TeX */ }
  });
}
if (typeof document$ !== "undefined") { document$.subscribe(oodvizTypeset); } else { document.addEventListener("DOMContentLoaded", oodvizTypeset); }
