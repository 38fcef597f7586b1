// CapyCTL dashboard, the Charts page: draws each deployment's four charts with uPlot from the page's JSON
// (#charts' data-source, GET /ui/charts/data), with its parks, wakes, switches and stops as dashed lines on the
// time axis, and draws them again every 30 s, and as soon as the live stream brings a deployment's marks that
// differ from those drawn. Served from this package like every script here (CSP: script-src 'self').
(function () {
  "use strict";
  var EVERY_MS = 30000;
  var MARK_COLOURS = {park: "#8a5a00", wake: "#1a7f37", "switch": "#8250df", stop: "#b3261e"};
  var SETTLE_MS = 100;  // after a fragment came: htmx has swapped it in by then
  var PLOTS = [
    {title: "TTFT (ms)", lines: [["ttft_p50_ms", "p50", "#0969da"], ["ttft_p95_ms", "p95", "#cf222e"]]},
    {title: "Decode (tokens/s)", lines: [["decode_tokens_per_second_p50", "p50", "#0969da"]]},
    {title: "Requests per second", lines: [["requests_per_second", "requests/s", "#0969da"]]},
    {title: "CapyCTL's wait in line (ms)", lines: [["queue_wait_p50_ms", "p50", "#0969da"],
                                                    ["queue_wait_p95_ms", "p95", "#cf222e"]]}
  ];
  var drawn = [];

  function drawMarks(marks) {
    return function (u) {
      var ctx = u.ctx, top = u.bbox.top, bottom = u.bbox.top + u.bbox.height;
      var ratio = window.devicePixelRatio || 1;
      ctx.save();
      ctx.lineWidth = ratio;
      ctx.setLineDash([4 * ratio, 3 * ratio]);
      ctx.font = (10 * ratio) + "px sans-serif";
      marks.forEach(function (mark) {
        var x = Math.round(u.valToPos(mark.at, "x", true));
        if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) { return; }
        ctx.strokeStyle = ctx.fillStyle = MARK_COLOURS[mark.kind] || "#57606a";
        ctx.beginPath();
        ctx.moveTo(x, top);
        ctx.lineTo(x, bottom);
        ctx.stroke();
        ctx.fillText(mark.kind, x + 3 * ratio, top + 10 * ratio);
      });
      ctx.restore();
    };
  }

  function plot(box, spec, data, chart, width) {
    var series = [{}], values = [data.times];
    spec.lines.forEach(function (line) {
      series.push({label: line[1], stroke: line[2], width: 1.5, points: {show: true, size: 5}});
      values.push(chart.series[line[0]]);
    });
    var opts = {title: spec.title, width: width, height: 170, series: series, scales: {x: {time: true}},
                axes: [{}, {size: 56}], hooks: {draw: [drawMarks(chart.marks)]}};
    return new window.uPlot(opts, values, box);
  }

  function draw(root, data) {
    drawn.forEach(function (u) { u.destroy(); });
    drawn = [];
    data.deployments.forEach(function (chart) {
      var section = root.querySelector('section.chart[data-deployment="' + CSS.escape(chart.name) + '"]');
      var box = section && section.querySelector(".plots");
      if (!box) { return; }  // a deployment added since the page was loaded: shown on the next load
      var width = Math.max(280, Math.floor((box.clientWidth - 48) / 2));  // two a row, room for the gap
      PLOTS.forEach(function (spec) { drawn.push(plot(box, spec, data, chart, width)); });
      section.dataset.drawn = String(PLOTS.length);
    });
    root.dataset.state = "drawn";
  }

  function load(root) {
    fetch(root.dataset.source, {headers: {accept: "application/json"}, credentials: "same-origin"})
      .then(function (answer) {
        if (!answer.ok) { throw new Error("the charts' data answered " + answer.status); }
        return answer.json();
      })
      .then(function (data) { draw(root, data); })
      .catch(function () { root.dataset.state = "failed"; });
  }

  function marksText(box) { return box.textContent.replace(/\s+/g, " ").trim(); }

  // The stream sends every deployment's marks when it (re)connects, and again when they change: draw again
  // only when what it brought differs from what was drawn.
  function watchMarks(root) {
    var pending = false;
    root.querySelectorAll(".marks-box").forEach(function (box) { box.dataset.drawnMarks = marksText(box); });
    document.body.addEventListener("htmx:sseMessage", function (event) {
      if (pending || !event.target.classList || !event.target.classList.contains("marks-box")) { return; }
      pending = true;
      window.setTimeout(function () {
        pending = false;
        var changed = false;
        root.querySelectorAll(".marks-box").forEach(function (box) {
          var now = marksText(box);
          if (box.dataset.drawnMarks !== now) { changed = true; box.dataset.drawnMarks = now; }
        });
        if (changed) { load(root); }
      }, SETTLE_MS);
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("charts");
    if (!root || !window.uPlot) { return; }
    load(root);
    watchMarks(root);
    window.setInterval(function () { load(root); }, EVERY_MS);
  });
})();
