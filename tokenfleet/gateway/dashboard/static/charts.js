// The overview's charts: the last hour of the fleet's series, one SVG polyline per series (no library).
"use strict";

function chart(svg, series, colors) {
  // one polyline per series over the last hour; the y axis from 0 to the largest value
  const width = 320, height = 90, pad = 2;
  const points = series[0];
  const top = Math.max(1e-9, ...series.flat().filter((v) => v !== null));
  const x = (i) => pad + (i * (width - 2 * pad)) / Math.max(1, points.length - 1);
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren();
  const ns = "http://www.w3.org/2000/svg";
  series.forEach((values, k) => {
    const line = document.createElementNS(ns, "polyline");
    const coords = values.map((v, i) => (v === null ? null : `${x(i).toFixed(1)},${y(v).toFixed(1)}`)).filter(Boolean);
    line.setAttribute("points", coords.join(" "));
    line.setAttribute("stroke", colors[k]);
    svg.append(line);
    values.forEach((v, i) => { // a lone point draws no line: mark it
      if (v === null || (values[i - 1] ?? null) !== null || (values[i + 1] ?? null) !== null) return;
      const dot = document.createElementNS(ns, "circle");
      dot.setAttribute("cx", x(i)); dot.setAttribute("cy", y(v)); dot.setAttribute("r", 2);
      dot.setAttribute("fill", colors[k]);
      svg.append(dot);
    });
  });
  svg.parentElement.querySelector(".scale").textContent = "max " + (top >= 100 ? Math.round(top) : +top.toPrecision(3)) + ", last hour";
}

let drawnSeries = null; // the series on screen: it changes once per 10-second slot, not per poll

function drawCharts(series) {
  const shown = JSON.stringify(series);
  if (shown === drawnSeries) return;
  drawnSeries = shown;
  const last = (name) => { for (let i = series.length - 1; i >= 0; i--) if (series[i][name] !== null) return series[i][name]; return null; };
  chart($("#chart-tokens"), [series.map((p) => p.tokens_per_s)], ["#2b6cb0"]);
  chart($("#chart-ttft"), [series.map((p) => p.ttft_ms), series.map((p) => p.ttft_p50_ms)], ["#c05621", "#b7791f"]);
  chart($("#chart-queue"), [series.map((p) => p.queue_ms)], ["#2f855a"]);
  const recent = series.slice(-1)[0] || {};
  $("#now-tokens").textContent = recent.tokens_per_s ?? "";
  $("#now-ttft").textContent = last("ttft_ms") ?? "";
  $("#now-queue").textContent = last("queue_ms") ?? "";
}
