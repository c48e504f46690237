// The REST API from the browser: every call sends the stored HTTP Basic
// credentials (sessionStorage: gone when the tab closes) and turns an error
// reply {"error", "code"} into an ApiError that pages show as it is.

const KEY = "txbroker.auth";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
  // "no queue 'x' (NOT_FOUND, HTTP 404)"
  describe() {
    return `${this.message} (${this.code || "error"}, HTTP ${this.status})`;
  }
}

export const auth = {
  get() {
    const raw = sessionStorage.getItem(KEY);
    return raw ? JSON.parse(raw) : null;
  },
  set(user, password) {
    const bytes = new TextEncoder().encode(`${user}:${password}`);
    const token = btoa(String.fromCharCode(...bytes));
    sessionStorage.setItem(KEY, JSON.stringify({ user, token }));
  },
  clear() { sessionStorage.removeItem(KEY); },
  // "open" (no users), "user" (logged in) or null (unknown yet)
  mode: null,
};

// Called when the broker answers 401: the app sends the user to the login page.
let onUnauthorized = () => {};
export function setUnauthorizedHandler(handler) { onUnauthorized = handler; }

export async function call(method, path, body, { credentials, withHeaders = false } = {}) {
  const headers = { Accept: "application/json" };
  const stored = credentials === undefined ? auth.get() : credentials;
  if (stored) headers.Authorization = `Basic ${stored.token}`;
  const init = { method, headers, credentials: "omit", cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, `the broker does not answer (${err.message})`, "UNREACHABLE");
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    const message = data && data.error ? data.error : text || response.statusText;
    const error = new ApiError(response.status, message, data && data.code);
    if (response.status === 401 && credentials === undefined) onUnauthorized(error);
    throw error;
  }
  return withHeaders ? { data, headers: response.headers } : data;
}

export const api = {
  overview: () => call("GET", "/api/overview"),
  queues: () => call("GET", "/api/queues"),
  // one page: {queues, total} (total: how many match the filter)
  queuePage: async (params) => {
    const query = new URLSearchParams(Object.entries(params).filter(([, v]) => v !== ""));
    const { data, headers } = await call("GET", `/api/queues?${query}`, undefined,
                                         { withHeaders: true });
    return { queues: data, total: Number(headers.get("X-Total-Count") || data.length) };
  },
  queue: (name) => call("GET", `/api/queues/${enc(name)}`),
  update: (name, settings) => call("PATCH", `/api/queues/${enc(name)}`, settings),
  remove: (name) => call("DELETE", `/api/queues/${enc(name)}`),
  purge: (name) => call("POST", `/api/queues/${enc(name)}/purge`),
  browse: (name, limit) => call("GET", `/api/queues/${enc(name)}/messages?limit=${limit}`),
  move: (name, args) => call("POST", `/api/queues/${enc(name)}/move`, args),
  connections: () => call("GET", "/api/connections"),
  closeConnection: (id) => call("DELETE", `/api/connections/${id}`),
  xa: () => call("GET", "/api/xa"),
  xaCommit: (xid) => call("POST", `/api/xa/${enc(xid)}/commit`),
  xaRollback: (xid) => call("POST", `/api/xa/${enc(xid)}/rollback`),
  xaForget: (xid) => call("DELETE", `/api/xa/${enc(xid)}`),
  router: () => call("GET", "/api/router"),
  routerExceptions: () => call("GET", "/api/router/exceptions"),
  routerCommit: (tid) => call("POST", `/api/router/exceptions/${enc(tid)}/commit`),
  routerDiscard: (tid) => call("DELETE", `/api/router/exceptions/${enc(tid)}`),
};

function enc(name) { return encodeURIComponent(name); }
