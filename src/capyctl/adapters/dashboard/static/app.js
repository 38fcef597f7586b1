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
})();
