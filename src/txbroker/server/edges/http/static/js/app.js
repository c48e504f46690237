// The console: hash routes, the login state in the header, and one poller per
// page. Each page module exports mount(view, params) -> {stop()}.

import { auth, call, setUnauthorizedHandler } from "./api.js";
import { h } from "./format.js";
import * as dashboard from "./pages/dashboard.js";
import * as queues from "./pages/queues.js";
import * as queue from "./pages/queue.js";
import * as connections from "./pages/connections.js";
import * as xa from "./pages/xa.js";
import * as router from "./pages/router.js";
import * as login from "./pages/login.js";

const ROUTES = [
  [/^#?\/?$/, dashboard, "dashboard"],
  [/^#\/queues$/, queues, "queues"],
  [/^#\/queues\/(.+)$/, queue, "queues"],
  [/^#\/connections$/, connections, "connections"],
  [/^#\/xa$/, xa, "xa"],
  [/^#\/router$/, router, "router"],
  [/^#\/login$/, login, null],
];

let current = null;

function route() {
  if (current) current.stop();
  current = null;
  const hash = location.hash || "#/";
  if (auth.mode === null) return;  // still finding out whether a login is needed
  if (auth.mode === "login" && hash !== "#/login") {
    location.hash = "#/login";
    return;
  }
  const view = document.getElementById("view");
  view.replaceChildren();
  for (const [pattern, page, nav] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of document.querySelectorAll("#nav a")) {
      link.classList.toggle("active", link.dataset.nav === nav);
    }
    document.getElementById("nav").hidden = nav === null;
    current = page.mount(view, match.slice(1).map(decodeURIComponent), { loggedIn, logout });
    return;
  }
  view.append(h("div", { class: "panel empty" }, "No such page. ",
    h("a", { href: "#/" }, "Back to the dashboard")));
}

function showWho() {
  const who = document.getElementById("who");
  who.replaceChildren();
  if (auth.mode === "open") {
    who.append(h("span", { class: "badge open", id: "open-broker",
      title: "This broker has no [users]: the API takes no login (loopback clients only)" },
      "open broker · no login needed"));
  } else if (auth.mode === "user") {
    who.append(h("span", { id: "user" }, `signed in as ${auth.get().user}`),
      h("button", { class: "small", id: "logout", onclick: logout }, "Log out"));
  }
}

function loggedIn() {
  auth.mode = "user";
  showWho();
  location.hash = "#/";
}

function logout() {
  auth.clear();
  auth.mode = "login";
  showWho();
  if (location.hash === "#/login") route();
  else location.hash = "#/login";
}

async function start() {
  setUnauthorizedHandler(() => {
    if (auth.mode !== "login") logout();
  });
  // Without credentials an open broker answers; one with users says 401.
  const stored = auth.get();
  try {
    await call("GET", "/api/overview", undefined, { credentials: stored });
    auth.mode = stored ? "user" : "open";
  } catch (err) {
    if (err.status !== 401) {
      auth.mode = stored ? "user" : "open";  // show the pages: they report the error
    } else {
      if (stored) {
        try {
          await call("GET", "/api/overview", undefined, { credentials: null });
          auth.mode = "open";
        } catch { auth.mode = "login"; }
      } else auth.mode = "login";
      if (auth.mode === "login") auth.clear();
    }
  }
  showWho();
  window.addEventListener("hashchange", route);
  route();
}

start();
