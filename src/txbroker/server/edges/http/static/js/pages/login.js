// Login: checks the user and password against the API (GET /api/overview with
// HTTP Basic) and keeps them in sessionStorage for this tab only.

import { auth, call } from "../api.js";
import { h } from "../format.js";

export function mount(view, params, { loggedIn }) {
  const error = h("div", { class: "error-box", id: "login-error", hidden: true });
  const user = h("input", { type: "text", id: "login-user", autocomplete: "username",
                            required: true, autofocus: true });
  const password = h("input", { type: "password", id: "login-password",
                                autocomplete: "current-password", required: true });
  const submit = h("button", { type: "submit", class: "primary", id: "login-submit" }, "Log in");
  const form = h("form", { onsubmit: async (event) => {
    event.preventDefault();
    submit.disabled = true;
    error.hidden = true;
    auth.set(user.value, password.value);
    try {
      await call("GET", "/api/overview", undefined, { credentials: auth.get() });
      loggedIn();
    } catch (err) {
      auth.clear();
      error.textContent = err.status === 401 ? `Login refused: ${err.message}` : err.describe();
      error.hidden = false;
      submit.disabled = false;
      password.select();
    }
  } },
  error,
  h("label", {}, "User", user),
  h("label", {}, "Password", password),
  submit);
  view.append(h("div", { class: "login panel" },
    h("h1", {}, "Log in"),
    h("p", { class: "muted" }, "This broker has users: the console calls its API with " +
      "your user and password (HTTP Basic). They are kept in this tab only."),
    form));
  user.focus();
  return { stop() {} };
}
