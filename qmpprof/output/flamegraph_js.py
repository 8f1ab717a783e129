"""The style and script embedded in every SVG flame graph (kept apart from the layout code).

The script makes the static drawing interactive: hover details, click to zoom, Reset Zoom, regex
search (button or Ctrl-F, Escape clears) with "Matched: P%", a case toggle, the choice between
the graphs of a file that holds several (``g.view``: wall, on CPU, off CPU), and the view, zoom
and search state kept in the URL fragment so a view can be shared. It reads geometry from data-*
attributes the writer puts on the <svg> and on every frame group, so the script text never changes.
"""

STYLE = """
text { font-family: Verdana, sans-serif; font-size: 12px; fill: #000; }
#title { font-size: 17px; }
#subtitle { fill: #555; }
.button { cursor: pointer; fill: #1a4d99; }
.button:hover { text-decoration: underline; }
.hidden { display: none; }
.view.button.active { font-weight: bold; cursor: default; text-decoration: none; }
g.f { cursor: pointer; }
g.f text { pointer-events: none; }
g.f:hover > rect { stroke: #000; stroke-width: 0.5; }
g.f.match > rect { fill: rgb(230, 0, 230); }
g.f.parent > rect { opacity: 0.5; }
"""

SCRIPT = """
"use strict";
(() => {
  const svg = document.documentElement;
  let total = Number(svg.dataset.total) || 1;
  const width = Number(svg.getAttribute("width"));
  const pad = Number(svg.dataset.pad);
  const charWidth = Number(svg.dataset.charWidth);
  let frames = Array.from(document.querySelectorAll("g.f"));
  const $ = (id) => document.getElementById(id);
  const details = $("details"), matched = $("matched"), reset = $("reset"), caseButton = $("case");
  const view = { x: 0, w: total, d: 0 };
  // A file with several graphs (wall, on CPU, off CPU): one shown, its own frames and total.
  const graphs = Array.from(document.querySelectorAll("g.view"));
  const switches = Array.from(document.querySelectorAll("text.view"));
  let shown = graphs.length ? graphs[0].dataset.view : "";
  let term = "";
  let ignoreCase = false;

  const num = (g, key) => Number(g.dataset[key]);
  const tooltip = (g) => g.querySelector("title").textContent;
  // The tooltip is "name (N samples, P%)"; names may hold " (" themselves, the suffix is last.
  const nameOf = (g) => tooltip(g).slice(0, tooltip(g).lastIndexOf(" ("));

  // The writer's rule: the whole name if it fits, else cut with "..", else nothing.
  function label(name, px) {
    const fit = Math.floor((px - 3) / charWidth);
    if (fit < 3) return "";
    return name.length <= fit ? name : name.slice(0, fit - 2) + "..";
  }

  function layout() {
    const scale = (width - 2 * pad) / view.w;
    for (const g of frames) {
      const left = Math.max(num(g, "x"), view.x);
      const right = Math.min(num(g, "x") + num(g, "w"), view.x + view.w);
      // Outside the zoomed span: hidden. Ancestors of the zoomed frame overlap it: full width.
      g.classList.toggle("hidden", right <= left);
      g.classList.toggle("parent", num(g, "d") < view.d);
      if (right <= left) continue;
      const px = (right - left) * scale;
      const x = pad + (left - view.x) * scale;
      g.querySelector("rect").setAttribute("x", x.toFixed(2));
      g.querySelector("rect").setAttribute("width", px.toFixed(2));
      const text = g.querySelector("text");
      text.setAttribute("x", (x + 3).toFixed(2));
      text.textContent = label(nameOf(g), px);
    }
    reset.classList.toggle("hidden", view.d === 0);
  }

  function save() {
    const params = new URLSearchParams();
    if (view.d > 0) {
      params.set("x", view.x);
      params.set("d", view.d);
    }
    if (graphs.length && shown !== graphs[0].dataset.view) params.set("v", shown);
    if (term) params.set("s", term);
    if (ignoreCase) params.set("i", "1");
    const hash = params.toString();
    history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
  }

  function zoom(x, w, d) {
    Object.assign(view, { x, w, d });
    layout();
    save();
  }

  function choose(name) {
    const graph = graphs.find((g) => g.dataset.view === name) || graphs[0];
    if (!graph) return;
    shown = graph.dataset.view;
    for (const g of graphs) g.classList.toggle("hidden", g !== graph);
    for (const t of switches) t.classList.toggle("active", t.dataset.view === shown);
    frames = Array.from(graph.querySelectorAll("g.f"));
    total = Number(graph.dataset.total) || 1;
    Object.assign(view, { x: 0, w: total, d: 0 });
  }

  function compile(text) {
    try {
      return new RegExp(text, ignoreCase ? "i" : "");
    } catch {
      return null; // reported as "Invalid regex" rather than thrown at the user
    }
  }

  function search(newTerm) {
    term = newTerm;
    const re = term ? compile(term) : null;
    const spans = [];
    for (const g of frames) {
      const hit = re !== null && re.test(nameOf(g));
      g.classList.toggle("match", hit);
      if (hit) spans.push([num(g, "x"), num(g, "w")]);
    }
    // Frames nest, so a match inside a matched frame adds no samples: count outermost spans.
    spans.sort((a, b) => a[0] - b[0] || b[1] - a[1]);
    let end = -1;
    let sum = 0;
    for (const [x, w] of spans) {
      if (x >= end) {
        sum += w;
        end = x + w;
      }
    }
    if (!term) matched.textContent = "";
    else if (re === null) matched.textContent = "Invalid regex";
    else matched.textContent = `Matched: ${((100 * sum) / total).toFixed(1)}%`;
    save();
  }

  function askSearch() {
    const answer = prompt("Search (regular expression):", term);
    if (answer !== null) search(answer);
  }

  function setCase(ignore) {
    ignoreCase = ignore;
    caseButton.textContent = ignore ? "Case: ignore" : "Case: match";
  }

  const frameOf = (event) => event.target.closest("g.f");
  $("frames").addEventListener("click", (e) => {
    const g = frameOf(e);
    if (g) zoom(num(g, "x"), num(g, "w"), num(g, "d"));
  });
  $("frames").addEventListener("mouseover", (e) => {
    const g = frameOf(e);
    if (g) details.textContent = "Function: " + tooltip(g);
  });
  $("frames").addEventListener("mouseout", () => {
    details.textContent = " ";
  });
  reset.addEventListener("click", () => zoom(0, total, 0));
  for (const t of switches) {
    t.addEventListener("click", () => {
      choose(t.dataset.view);
      layout();
      search(term);
    });
  }
  $("search").addEventListener("click", askSearch);
  caseButton.addEventListener("click", () => {
    setCase(!ignoreCase);
    search(term);
  });
  document.addEventListener("keydown", (e) => {
    if ((e.ctrlKey || e.metaKey) && e.key.toLowerCase() === "f") {
      e.preventDefault();
      askSearch();
    } else if (e.key === "Escape") {
      search("");
    }
  });

  const params = new URLSearchParams(location.hash.slice(1));
  setCase(params.get("i") === "1");
  choose(params.get("v") || shown);
  const start = frames.find(
    (g) => g.dataset.x === params.get("x") && g.dataset.d === params.get("d"),
  );
  if (start) Object.assign(view, { x: num(start, "x"), w: num(start, "w"), d: num(start, "d") });
  layout();
  search(params.get("s") || "");
})();
"""
