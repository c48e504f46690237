// The confirmation dialog and the notice in the corner.

let noticeTimer = null;

// A short message at the top right: success, or the API's error text.
export function notify(text, { error = false } = {}) {
  const box = document.getElementById("notice");
  box.textContent = text;
  box.className = error ? "notice error" : "notice";
  box.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => { box.hidden = true; }, error ? 10000 : 4000);
}

export function notifyError(err) {
  notify(err.describe ? err.describe() : String(err), { error: true });
}

// Resolves true when the user confirms. `action` is the confirm button's label.
export function confirmAction(title, text, action = "Confirm") {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = title;
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = action;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    document.getElementById("confirm-cancel").focus();
  });
}

// Run an action behind a confirmation; notify its result or its error.
export async function confirmed(title, text, action, run, success) {
  if (!(await confirmAction(title, text, action))) return null;
  try {
    const result = await run();
    notify(success(result));
    return result;
  } catch (err) {
    notifyError(err);
    return null;
  }
}

// Re-run `task` after each completion: every `interval` ms, or 10x the time the
// last run took when that is longer (a broker with 10,000 queues is not polled
// as often as a small one). Returns stop().
export function poll(task, interval) {
  let stopped = false, timer = null;
  async function tick() {
    const started = performance.now();
    try { await task(); } catch { /* the task shows its own errors */ }
    if (stopped) return;
    const took = performance.now() - started;
    timer = setTimeout(tick, Math.max(interval - took, took * 10, 50));
  }
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

