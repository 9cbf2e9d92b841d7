// The hover panel of oodviz's feature-space map (oodviz/ui/hover_thumbnail.py): a Streamlit v2 component
// that finds the map's plotly chart by its layout.meta and, while the mouse rests on a point, shows beside
// the cursor the point's set, source index, true class and prediction, and its thumbnail when the sprite
// has one. Everything comes from `data` (sent by Python once per page run): no network. Names are set as
// text (never as HTML): set and class names come from the run's config.

const PANEL_CLASS = "oodviz-hover-thumbnail";
const SHOWN_PX = 96;
const mounted = new Map();  // frontend key -> cleanup of the instance drawn last (one panel per instance)

function decode(b64, Type) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Type(bytes.buffer);
}

function makePanel() {
  const panel = document.createElement("div");
  panel.className = PANEL_CLASS;
  Object.assign(panel.style, {
    position: "fixed", display: "none", zIndex: "100000", pointerEvents: "none", background: "white",
    border: "1px solid #888", borderRadius: "4px", padding: "4px", font: "12px sans-serif", color: "#222",
    boxShadow: "0 2px 6px rgba(0,0,0,0.25)", maxWidth: "220px",
  });
  const image = document.createElement("img");
  image.width = SHOWN_PX;
  image.height = SHOWN_PX;
  image.alt = "thumbnail of the hovered sample";
  Object.assign(image.style, { imageRendering: "pixelated", display: "block" });
  const caption = document.createElement("div");
  panel.append(image, caption);
  document.body.append(panel);
  return { panel, image, caption };
}

export default function ({ data, key }) {
  if (mounted.has(key)) mounted.get(key)();  // drawn again with new data: replace, never stack, panels
  const sets = data.sets, classes = data.classes;
  const setOf = decode(data.set, Uint8Array), indexOf = decode(data.index, Int32Array);
  const labelOf = decode(data.label, Int16Array), predictionOf = decode(data.prediction, Int16Array);
  const tileOf = new Map();
  let sheet = null;
  if (data.sprite) {
    const positions = decode(data.positions, Int32Array), tiles = decode(data.tiles, Int32Array);
    positions.forEach((p, k) => tileOf.set(p, tiles[k]));
    sheet = new Image();
    sheet.src = data.sprite;
  }
  const tileURLs = new Map();
  const { panel, image, caption } = makePanel();
  const className = (c) => (c < 0 ? "OOD" : (classes[c] ?? String(c)));

  function tileURL(tile) {  // one tile of the sprite as its own PNG data URL (cached)
    if (!tileURLs.has(tile)) {
      const size = data.size, canvas = document.createElement("canvas");
      canvas.width = size;
      canvas.height = size;
      const x = (tile % data.columns) * size, y = Math.floor(tile / data.columns) * size;
      canvas.getContext("2d").drawImage(sheet, x, y, size, size, 0, 0, size, size);
      tileURLs.set(tile, canvas.toDataURL("image/png"));
    }
    return tileURLs.get(tile);
  }

  function onHover(event) {
    const point = event.points && event.points[0];
    if (!point || point.customdata === undefined) return;
    const row = Number(Array.isArray(point.customdata) ? point.customdata[0] : point.customdata);
    if (!(row >= 0 && row < indexOf.length)) return;
    const tile = tileOf.get(row);
    const shown = tile !== undefined && sheet && sheet.complete && sheet.naturalWidth > 0;
    image.style.display = shown ? "block" : "none";
    if (shown) image.src = tileURL(tile);
    panel.dataset.row = String(row);
    panel.dataset.tile = tile === undefined ? "" : String(tile);
    caption.textContent = `${sets[setOf[row]]} #${indexOf[row]} · true ${className(labelOf[row])} · ` +
      `predicted ${className(predictionOf[row])}` + (tile === undefined ? " (no thumbnail sent: click it)" : "");
    const mouse = event.event || {};
    const x = (mouse.clientX ?? 0) + 16, y = (mouse.clientY ?? 0) + 16;
    panel.style.display = "block";
    panel.style.left = `${Math.min(x, window.innerWidth - panel.offsetWidth - 8)}px`;
    panel.style.top = `${Math.min(y, window.innerHeight - panel.offsetHeight - 8)}px`;
  }

  function onUnhover() {
    panel.style.display = "none";
  }

  let chart = null;
  function attach() {  // the chart may be drawn after this component, or drawn anew by a rerun
    const found = [...document.querySelectorAll(".js-plotly-plot")].find((gd) => gd.layout && gd.layout.meta === data.meta);
    if (found === chart || !found || typeof found.on !== "function") return;
    detach();
    chart = found;
    chart.on("plotly_hover", onHover);
    chart.on("plotly_unhover", onUnhover);
  }
  function detach() {
    if (chart && typeof chart.removeListener === "function") {
      chart.removeListener("plotly_hover", onHover);
      chart.removeListener("plotly_unhover", onUnhover);
    }
    chart = null;
  }
  attach();
  const timer = setInterval(attach, 500);
  const cleanup = () => {
    clearInterval(timer);
    detach();
    panel.remove();
    if (mounted.get(key) === cleanup) mounted.delete(key);
  };
  mounted.set(key, cleanup);
  return cleanup;
}
