// tracerl ui: the token colour toggle, the token hover box, and live refresh. No dependencies.
"use strict";
(function () {
  function setScale(which) {
    document.body.classList.toggle("by-lp", which === "lp");
    document.body.classList.toggle("by-adv", which === "adv");
    var lp = document.getElementById("by-lp"), adv = document.getElementById("by-adv");
    if (lp && adv) { lp.classList.toggle("on", which === "lp"); adv.classList.toggle("on", which === "adv"); }
  }
  function wire() {
    var lp = document.getElementById("by-lp"), adv = document.getElementById("by-adv");
    if (lp && adv) {
      lp.addEventListener("click", function () { setScale("lp"); });
      adv.addEventListener("click", function () { setScale("adv"); });
    }
    var info = document.getElementById("tokinfo");
    if (info) {
      document.addEventListener("mouseover", function (e) {
        var t = e.target;
        if (t && t.classList && t.classList.contains("tok")) { info.textContent = t.getAttribute("title"); }
      });
    }
  }
  // Live: ask whether the store changed; if so, fetch this page again and swap its main content.
  function live() {
    var body = document.body;
    if (!body.dataset.live) { return; }
    var generation = body.dataset.live, every = parseInt(body.dataset.pollMs || "3000", 10);
    function tick() {
      fetch("/api/live", { credentials: "same-origin", cache: "no-store" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (d) {
          if (!d || String(d.generation) === generation) { return null; }
          generation = String(d.generation);
          return fetch(location.href, { credentials: "same-origin", cache: "no-store" })
            .then(function (r) { return r.ok ? r.text() : null; })
            .then(function (html) {
              if (!html) { return; }
              var doc = new DOMParser().parseFromString(html, "text/html");
              var fresh = doc.getElementById("main"), old = document.getElementById("main");
              if (fresh && old) { old.replaceWith(document.importNode(fresh, true)); }
              var badge = document.getElementById("live");
              if (badge) {
                badge.textContent = "updated " + new Date().toLocaleTimeString();
                badge.classList.add("flash");
                setTimeout(function () { badge.classList.remove("flash"); }, 1500);
              }
            });
        })
        .catch(function () { /* the server may be restarting: try again next tick */ })
        .then(function () { setTimeout(tick, every); });
    }
    setTimeout(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () { wire(); live(); });
})();
