/* elockd status page: the live lock table, kept live over the WebSocket `watch`.
 *
 * Two WebSocket sessions on "/" of this page's own port (docs/status-page.md):
 *   - the watch session: `watch PREFIX` sends a snapshot of the holds, `SYNCED`, then
 *     one line per grant and free. The table is these holds, nothing else: it never
 *     polls. Any line sent after `watch` would end the stream, so it sends none.
 *   - the query session: `ls PREFIX` once the snapshot is in (the ages of the holds
 *     the snapshot had, the ttl and waiters of each key), `info K` for a key after
 *     one of its events (its waiters and lease then), and `q` for the server's
 *     counters at most every few seconds, and only after something changed.
 * With --auth-token-file both begin with `auth TOKEN`; the token lives in
 * sessionStorage (this tab only, gone when it closes) and nothing is shown without it.
 * Data only ever reaches the document through textContent and dataset: never markup.
 */
"use strict";

(function () {
  const TOKEN_KEY = "elockd.status.token";
  const MAX_ROWS = 2000; // rows drawn at most; the rest are counted under the table
  const LS_LIMIT = 100000; // lines asked of `ls` at most
  const RENDER_DELAY = 50; // ms: events that come together are drawn together
  const INFO_SPACING = 50; // ms between two `info` requests
  const Q_INTERVAL = 5000; // ms: the server's counters, read at most this often
  const FILTER_DELAY = 400; // ms of no typing before the watch moves to a new prefix
  const RETRY_FIRST = 1000;
  const UNAVAILABLE = "409 Backend Unavailable"; // a cluster node that cannot vouch
  const NO_VOUCH = "the node cannot vouch for its lock table now (cut off from etcd?)";
  const RETRY_MAX = 15000;

  const $ = (id) => document.getElementById(id);
  const now = () => performance.now();

  // ---- state -------------------------------------------------------------------
  let generation = 0; // bumped on every (re)subscription: stale callbacks check it
  let watch = null; // the watch WebSocket
  let query = null; // the query session (class Query)
  let subscribed = null; // the prefix the watch was opened with
  let filter = ""; // the prefix typed: applied to the rows at once
  let rows = null; // the holds shown (class Holds), set in init
  let nextId = 1;
  const keys = new Map(); // key -> {waiting, ttlDeadline, token}
  const dirty = new Set(); // keys whose `info` is to be read again
  let infoBusy = false;
  let sortBy = "key";
  let sortDir = 1;
  let events = 0;
  let renderTimer = null;
  let qTimer = null;
  let qLast = 0;
  let retryDelay = RETRY_FIRST;
  let retryTimer = null;
  let filterTimer = null;

  function wsUrl() {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/";
  }

  function lines(text) {
    const out = String(text).split(/\r?\n/);
    if (out.length && out[out.length - 1] === "") out.pop();
    return out;
  }

  function setState(text, phase, problem) {
    const state = $("state");
    state.textContent = text;
    state.classList.toggle("problem", Boolean(problem));
    document.body.dataset.phase = phase;
  }

  // ---- the query session ---------------------------------------------------------
  /** One request line, one reply message, in order; reopened when it was closed. */
  class Query {
    constructor(token) {
      this.token = token;
      this.ws = null;
      this.pending = [];
      this.unsent = [];
    }

    ensure() {
      if (this.ws !== null) return;
      const ws = new WebSocket(wsUrl());
      this.ws = ws;
      ws.onopen = () => {
        for (const line of this.unsent.splice(0)) ws.send(line);
      };
      ws.onmessage = (event) => {
        const waiter = this.pending.shift();
        if (waiter) waiter.resolve(String(event.data));
      };
      ws.onclose = () => {
        if (this.ws === ws) this.ws = null;
        for (const waiter of this.pending.splice(0)) waiter.reject(new Error("closed"));
        this.unsent = [];
      };
      if (this.token !== null) this.request("auth " + this.token).catch(() => {});
    }

    request(line) {
      this.ensure();
      return new Promise((resolve, reject) => {
        this.pending.push({ resolve, reject });
        if (this.ws.readyState === WebSocket.OPEN) this.ws.send(line);
        else this.unsent.push(line);
      });
    }

    close() {
      if (this.ws !== null) this.ws.close();
      this.ws = null;
    }
  }

  // ---- parsing -------------------------------------------------------------------
  // Keys and owners are blank-free in the word family; a terse key may hold blanks,
  // so the fixed words are matched from the right and the key is the shortest prefix.
  const GRANT_EXCLUSIVE = /^\+ (.+?) exclusive (.+) token=(\d+)$/;
  const GRANT_SHARED = /^\+ (.+?) shared (.+) holders=(\d+)$/;
  const FREE_EXCLUSIVE = /^- (.+?) exclusive (.+) (released|expired|orphaned|killed)$/;
  const FREE_SHARED = /^- (.+?) shared (.+) holders=(\d+) (released|expired|orphaned|killed)$/;
  const LS_LINE =
    /^(.+?) exclusive=(.+) shared=(\d+) waiting=(\d+) age=(\S+) token=(\S+) ttl=(\S+)$/;
  const INFO_LINE = / waiting=(\d+) ttl=(\S+) token=(\S+)$/;

  function parseEvent(line) {
    let m;
    if (line.startsWith("+ ")) {
      if ((m = GRANT_SHARED.exec(line))) return { grant: true, key: m[1], kind: "shared", owner: m[2] };
      if ((m = GRANT_EXCLUSIVE.exec(line)))
        return { grant: true, key: m[1], kind: "exclusive", owner: m[2], token: m[3] };
    } else if (line.startsWith("- ")) {
      if ((m = FREE_SHARED.exec(line)))
        return { grant: false, key: m[1], kind: "shared", owner: m[2], why: m[4] };
      if ((m = FREE_EXCLUSIVE.exec(line)))
        return { grant: false, key: m[1], kind: "exclusive", owner: m[2], why: m[3] };
    }
    return null;
  }

  function seconds(text) {
    const value = Number(text);
    return text === "-" || !Number.isFinite(value) ? null : value;
  }

  // ---- the table -----------------------------------------------------------------
  /** The holds, by id and by key: an event or an `ls` line costs O(holds of its key). */
  class Holds {
    constructor() {
      this.byId = new Map();
      this.byKey = new Map();
    }

    add(row) {
      this.byId.set(row.id, row);
      let set = this.byKey.get(row.key);
      if (!set) this.byKey.set(row.key, (set = new Set()));
      set.add(row);
    }

    remove(row) {
      this.byId.delete(row.id);
      const set = this.byKey.get(row.key);
      set.delete(row);
      if (set.size === 0) this.byKey.delete(row.key);
    }

    of(key) {
      return this.byKey.get(key) || new Set();
    }

    values() {
      return this.byId.values();
    }
  }

  function keyState(key) {
    let state = keys.get(key);
    if (!state) {
      state = { waiting: null, ttlDeadline: null, token: null };
      keys.set(key, state);
    }
    return state;
  }

  function addRow(table, event, granted) {
    const row = {
      id: nextId++,
      key: event.key,
      kind: event.kind,
      owner: event.owner,
      token: event.token || null,
      granted, // performance.now() of the grant, or null until `ls` tells the age
      approximate: false, // the key's oldest hold's age (a shared hold seen in the snapshot)
      tr: null,
    };
    table.add(row);
    return row;
  }

  function removeRow(event) {
    let found = null;
    for (const row of rows.of(event.key)) {
      if (row.kind !== event.kind) continue;
      if (event.kind === "exclusive" || row.owner === event.owner) {
        // Two sessions may share a name (iam): the oldest hold of that name goes.
        if (found === null || (row.granted ?? -Infinity) < (found.granted ?? -Infinity)) found = row;
        if (event.kind === "exclusive") break;
      }
    }
    if (found !== null) rows.remove(found);
  }

  function shownRows() {
    const list = [];
    for (const row of rows.values()) if (row.key.startsWith(filter)) list.push(row);
    const age = (row) => (row.granted === null ? Infinity : row.granted);
    list.sort((a, b) => {
      if (sortBy === "age") {
        // An earlier grant is an older hold; sortDir -1 ("descending" age): the oldest first.
        const diff = age(a) - age(b);
        if (diff) return (diff > 0 ? 1 : -1) * -sortDir;
      }
      if (a.key !== b.key) return (a.key < b.key ? -1 : 1) * (sortBy === "key" ? sortDir : 1);
      if (a.kind !== b.kind) return a.kind < b.kind ? -1 : 1;
      return a.id - b.id;
    });
    return list;
  }

  function formatAge(total) {
    const s = Math.max(0, Math.floor(total));
    const two = (n) => String(n).padStart(2, "0");
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m" + two(s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h" + two(Math.floor((s % 3600) / 60)) + "m";
    return Math.floor(s / 86400) + "d" + two(Math.floor((s % 86400) / 3600)) + "h";
  }

  function cell(tr, name, numeric) {
    const td = document.createElement("td");
    td.className = name + (numeric ? " number" : "");
    tr.appendChild(td);
    return td;
  }

  function build(row) {
    const tr = document.createElement("tr");
    tr.dataset.key = row.key;
    tr.dataset.kind = row.kind;
    cell(tr, "key").textContent = row.key;
    cell(tr, "kind").textContent = row.kind;
    cell(tr, "owner").textContent = row.owner;
    row.ageCell = cell(tr, "age", true);
    row.tokenCell = cell(tr, "token", true);
    row.ttlCell = cell(tr, "ttl", true);
    row.waitersCell = cell(tr, "waiters", true);
    row.tr = tr;
  }

  function paintTimes(row, t) {
    if (row.granted === null) {
      row.ageCell.textContent = "…";
      delete row.ageCell.dataset.seconds;
    } else {
      const age = (t - row.granted) / 1000;
      row.ageCell.textContent = (row.approximate ? "≥" : "") + formatAge(age);
      row.ageCell.dataset.seconds = String(Math.floor(age));
      row.ageCell.title = age.toFixed(1) + " s" + (row.approximate ? " (the key's oldest hold)" : "");
    }
    const state = keys.get(row.key);
    let ttl = "-";
    if (row.kind === "exclusive" && state && state.ttlDeadline !== null) {
      const left = (state.ttlDeadline - t) / 1000;
      ttl = Math.max(0, left).toFixed(0) + "s";
      if (left <= 0 && !state.ttlAsked) {
        // The lease ran out, or was renewed (renewals make no event): ask again.
        state.ttlAsked = true;
        refresh(row.key);
      }
    }
    row.ttlCell.textContent = ttl;
  }

  function paint(row, t) {
    if (row.tr === null) build(row);
    const state = keys.get(row.key);
    const token = row.token ?? (row.kind === "exclusive" && state ? state.token : null);
    row.tokenCell.textContent = token ?? "-";
    row.waitersCell.textContent = state && state.waiting !== null ? String(state.waiting) : "…";
    paintTimes(row, t);
  }

  let painted = [];

  function render() {
    renderTimer = null;
    const t = now();
    const list = shownRows();
    painted = list.slice(0, MAX_ROWS);
    for (const row of painted) paint(row, t);
    $("rows").replaceChildren(...painted.map((row) => row.tr));
    $("more").textContent =
      list.length > MAX_ROWS ? `${list.length - MAX_ROWS} more holds not shown: narrow the prefix` : "";
    const shownKeys = new Set(list.map((row) => row.key));
    let waiting = 0;
    for (const key of shownKeys) waiting += (keys.get(key) || {}).waiting || 0;
    $("c-holds").textContent = String(list.length);
    $("c-exclusive").textContent = String(list.filter((row) => row.kind === "exclusive").length);
    $("c-shared").textContent = String(list.filter((row) => row.kind === "shared").length);
    $("c-waiting").textContent = String(waiting);
    $("c-events").textContent = String(events);
  }

  function scheduleRender() {
    if (renderTimer === null) renderTimer = setTimeout(render, RENDER_DELAY);
  }

  function tick() {
    const t = now();
    for (const row of painted) paintTimes(row, t);
  }

  // ---- queries: ls, info, q ------------------------------------------------------
  function prefixArg(prefix) {
    return prefix === "" ? "" : " " + prefix;
  }

  function readListing(gen) {
    query.request(`ls${prefixArg(subscribed)} limit=${LS_LIMIT}`).then((reply) => {
      if (gen !== generation) return;
      const t = now();
      for (const line of lines(reply)) {
        const m = LS_LINE.exec(line);
        if (!m) continue;
        const [, key, , , waiting, age, token, ttl] = m;
        const state = keyState(key);
        state.waiting = Number(waiting);
        state.token = token === "-" ? null : token;
        const left = seconds(ttl);
        state.ttlDeadline = left === null ? null : t + left * 1000;
        state.ttlAsked = false;
        const oldest = seconds(age);
        if (oldest === null) continue;
        const unknown = [...rows.of(key)].filter((row) => row.granted === null);
        for (const row of unknown) {
          row.granted = t - oldest * 1000;
          row.approximate = row.kind === "shared" && unknown.length > 1;
        }
      }
      for (const row of rows.values()) if (row.granted === null) refresh(row.key);
      scheduleRender();
    }, () => {});
  }

  function refresh(key) {
    if (/\s/.test(key)) return; // `info` takes one word
    dirty.add(key);
    pumpInfo(generation);
  }

  function held(key) {
    return rows.byKey.has(key);
  }

  function pumpInfo(gen) {
    if (infoBusy || query === null) return;
    let key;
    do {
      if (dirty.size === 0) return;
      key = dirty.values().next().value;
      dirty.delete(key);
      if (!held(key)) keys.delete(key); // no row shows its waiters: nothing to ask
    } while (!held(key));
    infoBusy = true;
    query.request("info " + key).then(
      (reply) => {
        if (gen !== generation) return;
        const m = INFO_LINE.exec(lines(reply)[0] || "");
        if (m) {
          const state = keyState(key);
          state.waiting = Number(m[1]);
          const left = seconds(m[2]);
          state.ttlDeadline = left === null ? null : now() + left * 1000;
          state.ttlAsked = false;
          state.token = m[3] === "-" ? null : m[3];
          scheduleRender();
        }
        // Spaced out: a page on a busy server asks at most 1000/INFO_SPACING a second.
        setTimeout(() => {
          if (gen !== generation) return;
          infoBusy = false;
          pumpInfo(gen);
        }, INFO_SPACING);
      },
      () => {
        if (gen === generation) infoBusy = false;
      },
    );
  }

  function readCounters(gen) {
    qTimer = null;
    qLast = now();
    query.request("q").then((reply) => {
      if (gen !== generation) return;
      for (const line of lines(reply)) {
        const m = /^([a-z_]+): (\d+)$/.exec(line);
        const dd = m && $("q-" + m[1]);
        if (dd) dd.textContent = m[2];
      }
    }, () => {});
  }

  function countersChanged(gen) {
    if (qTimer !== null) return;
    const wait = Math.max(0, qLast + Q_INTERVAL - now());
    qTimer = setTimeout(() => readCounters(gen), wait);
  }

  // ---- the watch session ---------------------------------------------------------
  function stop() {
    generation++;
    for (const timer of [retryTimer, qTimer]) if (timer !== null) clearTimeout(timer);
    retryTimer = qTimer = null;
    if (watch !== null) {
      watch.onclose = watch.onmessage = watch.onopen = null;
      watch.close();
      watch = null;
    }
    if (query !== null) query.close();
    query = null;
    dirty.clear();
    infoBusy = false;
  }

  function forget() {
    rows = new Holds();
    keys.clear();
    events = 0;
    painted = [];
    $("rows").replaceChildren();
    $("live").hidden = true;
  }

  function askToken(message) {
    stop();
    forget();
    sessionStorage.removeItem(TOKEN_KEY);
    $("auth-message").textContent = message;
    $("auth").hidden = false;
    setState("a token is needed to show the locks", "auth", false);
    $("token").focus();
  }

  function retry(why) {
    stop();
    $("live").classList.add("stale");
    setState(`${why}; trying again in ${Math.round(retryDelay / 1000)} s`, "disconnected", true);
    retryTimer = setTimeout(start, retryDelay);
    retryDelay = Math.min(RETRY_MAX, retryDelay * 2);
  }

  function start() {
    stop();
    const gen = generation;
    const token = sessionStorage.getItem(TOKEN_KEY);
    subscribed = filter;
    setState("connecting…", "connecting", false);
    const ws = new WebSocket(wsUrl());
    watch = ws;
    let phase = token === null ? "reply" : "auth";
    let pending = null; // the snapshot, swapped in at SYNCED

    ws.onopen = () => {
      if (token !== null) ws.send("auth " + token);
      ws.send("watch" + prefixArg(subscribed));
    };
    ws.onmessage = (message) => {
      if (gen !== generation) return;
      for (const line of lines(message.data)) {
        if (phase === "auth") {
          if (line === "200 OK") phase = "reply";
          else if (line.startsWith("403")) return askToken("That token was refused.");
          else return retry(`unexpected reply to auth: ${line}`);
        } else if (phase === "reply") {
          if (line === "200 Watching") {
            phase = "snapshot";
            pending = new Holds();
          } else if (line.startsWith("403")) {
            return askToken("");
          } else if (line.startsWith("413") || line.startsWith("0 Too Many")) {
            return retry(`the server refused: ${line}`);
          } else if (line === UNAVAILABLE) {
            return retry(NO_VOUCH);
          } else {
            stop();
            return setState(`the server cannot watch (${line}): is it an elockd with watch?`, "error", true);
          }
        } else if (line === UNAVAILABLE) {
          // The deadline gate: the node can no longer vouch for the table (cut off
          // from etcd, or past its lease's deadline). The stream ends here.
          return retry(NO_VOUCH);
        } else if (phase === "snapshot") {
          if (line === "SYNCED") {
            phase = "live";
            synced(gen, pending);
          } else {
            const event = parseEvent(line);
            if (event && event.grant) addRow(pending, event, null);
          }
        } else if (line === "OVERFLOW") {
          return retry("this page fell behind the events (OVERFLOW)");
        } else {
          const event = parseEvent(line);
          if (event === null) continue;
          events++;
          if (event.grant) addRow(rows, event, now());
          else removeRow(event);
          refresh(event.key);
          countersChanged(gen);
          scheduleRender();
        }
      }
    };
    ws.onclose = (close) => {
      if (gen !== generation) return;
      const why =
        phase === "reply" && close.code === 1006 && !close.wasClean
          ? "the WebSocket on / was refused or lost (with --tls-cert it is off)"
          : `the connection closed (code ${close.code})`;
      retry(why);
    };
  }

  function synced(gen, snapshot) {
    rows = snapshot;
    keys.clear();
    retryDelay = RETRY_FIRST;
    query = new Query(sessionStorage.getItem(TOKEN_KEY));
    $("auth").hidden = true;
    $("live").hidden = false;
    $("live").classList.remove("stale");
    const what = subscribed === "" ? "all keys" : `keys under “${subscribed}”`;
    setState(`live: watching ${what}`, "live", false);
    readListing(gen);
    readCounters(gen);
    render();
  }

  // ---- controls ------------------------------------------------------------------
  function sortOn(column) {
    if (sortBy === column) sortDir = -sortDir;
    else {
      sortBy = column;
      sortDir = column === "age" ? -1 : 1; // age: the oldest first
    }
    // "descending" age: the oldest (largest age) first.
    $("sort-key").setAttribute("aria-sort", sortBy !== "key" ? "none" : sortDir > 0 ? "ascending" : "descending");
    $("sort-age").setAttribute("aria-sort", sortBy !== "age" ? "none" : sortDir < 0 ? "descending" : "ascending");
    render();
  }

  function filterTyped() {
    const value = $("prefix").value;
    if (/\s/.test(value)) {
      $("prefix-message").textContent = "a prefix is one word: no blanks";
      return;
    }
    $("prefix-message").textContent = "";
    filter = value;
    const url = new URL(location.href);
    if (value === "") url.searchParams.delete("prefix");
    else url.searchParams.set("prefix", value);
    history.replaceState(null, "", url);
    render();
    if (filterTimer !== null) clearTimeout(filterTimer);
    filterTimer = setTimeout(() => {
      filterTimer = null;
      if (filter !== subscribed && document.body.dataset.phase !== "auth") start();
    }, FILTER_DELAY);
  }

  function init() {
    rows = new Holds();
    const initial = new URL(location.href).searchParams.get("prefix") || "";
    if (!/\s/.test(initial)) filter = initial;
    $("prefix").value = filter;
    $("prefix").addEventListener("input", filterTyped);
    $("sort-key").addEventListener("click", () => sortOn("key"));
    $("sort-age").addEventListener("click", () => sortOn("age"));
    $("auth").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token").value.trim();
      if (token === "") return;
      if (/\s/.test(token)) {
        $("auth-message").textContent = "A token has no blanks.";
        return;
      }
      sessionStorage.setItem(TOKEN_KEY, token);
      $("token").value = "";
      $("auth").hidden = true;
      start();
    });
    setInterval(tick, 1000);
    start();
  }

  init();
})();
