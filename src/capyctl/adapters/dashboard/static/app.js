// CapyCTL dashboard: says whether the page's live stream is up. The stream itself is htmx's SSE extension;
// each fragment it brings replaces the element whose sse-swap names it. No inline script anywhere (CSP).
(function () {
  "use strict";
  function say(state, text) {
    var live = document.getElementById("live");
    if (live) {
      live.dataset.state = state;
      live.textContent = text;
    }
  }
  document.addEventListener("htmx:sseOpen", function (event) {
    say("live", "live");
    var source = event.detail && event.detail.source;
    if (source && !source.capyctlWatched) {
      source.capyctlWatched = true;
      source.addEventListener("signed-out", function () { source.close(); window.location.reload(); });
      source.addEventListener("closing", function () { say("dropped", "the server is stopping; reconnecting when it is back…"); });
    }
  });
  document.addEventListener("htmx:sseError", function () {
    say("dropped", "live updates lost; reconnecting… (what you see may be out of date)");
  });
  // A button data-download="ID" data-filename="NAME" saves the text of element ID as the file NAME: through a
  // blob in memory, so the text (a join file's secret) never travels in a URL.
  document.addEventListener("click", function (event) {
    var button = event.target.closest ? event.target.closest("button[data-download]") : null;
    var source = button && document.getElementById(button.dataset.download);
    if (!source) { return; }
    var link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([source.value || source.textContent], {type: "application/json"}));
    link.download = button.dataset.filename;
    document.body.appendChild(link);
    link.click();
    link.remove();
    window.setTimeout(function () { URL.revokeObjectURL(link.href); }, 1000);
  });
})();
