// A gossipd producer in JavaScript (Node >= 18, zeromq.js 6, @msgpack/msgpack 3), written
// from docs/PROTOCOL.md alone: no gossipd code is read or imported.  tests/test_js_producer.py
// runs it against real daemons, plain and with CURVE, and asserts the JSON report it prints.
//
//   node producer.mjs keygen DIR NAME      write DIR/NAME.key (public) and DIR/NAME.key_secret
//   node producer.mjs run CONFIG_JSON      run the checks; prints one JSON report line
//
// CONFIG_JSON: {"endpoint": "tcp://127.0.0.1:PORT", "tasks": 2000, "status": true,
//               "curve": {"server_key_file": ".../NODE.key", "key_file": ".../NAME.key_secret"}}
// Every ZeroMQ message must be one frame (PROTOCOL.md, "Each message is one ZeroMQ frame"):
// a message of more parts is a failure, not something to work around.

import { readFileSync, writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { Push, Pull, curveKeyPair } from "zeromq";
import { encode, decode } from "@msgpack/msgpack";

const MSG = { TASK: 1, CHUNK: 2, RESULT: 3, CANCEL: 4, REPLIES: 5, TASKS: 6, STATUS_QUERY: 30, STATUS_REPORT: 31 };
const RETRIED = new Set(["overloaded", "shutting_down", "over_budget"]);
const EMOJI = "\u{1F600}"; // one code point, four UTF-8 bytes, JavaScript .length 2
const MSGPACK = { useBigInt64: true }; // 64-bit integers (seed, checksum) as BigInt

// --- key files (PROTOCOL.md, "Key files") --------------------------------------------------

function writeKeyFiles(dir, name) {
  const { publicKey, secretKey } = curveKeyPair();
  mkdirSync(dir, { recursive: true });
  // The minimal files the daemon accepts: one line each, nothing else.
  writeFileSync(join(dir, `${name}.key`), `public-key = "${publicKey}"\n`);
  writeFileSync(
    join(dir, `${name}.key_secret`),
    `public-key = "${publicKey}"\nsecret-key = "${secretKey}"\n`,
    { mode: 0o600 },
  );
  return publicKey;
}

function readKeyFile(path) {
  const keys = {};
  for (const raw of readFileSync(path, "utf8").split("\n")) {
    const line = raw.trim();
    if (line.startsWith("#")) continue;
    for (const field of ["public-key", "secret-key"]) {
      if (line.startsWith(field) && !(field in keys)) {
        keys[field] = line.slice(line.indexOf("=") + 1).replace(/^[ \t'"]+|[ \t'"]+$/g, "");
      }
    }
  }
  if (!keys["public-key"] || keys["public-key"].length !== 40) {
    throw new Error(`${path}: no 40-character public-key line`);
  }
  return { publicKey: keys["public-key"], secretKey: keys["secret-key"] };
}

// --- what the echo engine answers (PROTOCOL.md, "The echo engine") ---------------------------

function echoText(prompt, maxTokens) {
  const words = prompt.split(/\s+/).filter((w) => w.length > 0); // ASCII prompts only here
  if (words.length === 0) words.push("<empty>");
  const out = [];
  for (let i = 0; i < maxTokens; i++) out.push((i ? " " : "") + words[i % words.length]);
  return out;
}

// --- the run ---------------------------------------------------------------------------------

const WORDS = ["red", "green", "blue", "amber", "teal", "violet", "ochre", "slate"];

function mixedTask(i, replyTo) {
  const prompt = Array.from({ length: 1 + (i % 5) }, (_, k) => WORDS[(i * 7 + k * 3) % WORDS.length]).join(
    i % 2 ? " " : "  \t",
  );
  const task = {
    v: 1,
    t: MSG.TASK,
    id: `js-${i}`,
    prompt,
    reply_to: replyTo,
    // temperature 1 and top_p 1 are written as MessagePack integers (float fields take them).
    params: { max_tokens: 1 + (i % 9), temperature: i % 2 ? 1 : 0.5, top_p: 1 },
  };
  if (i % 3 === 0) task.stream = true;
  if (i % 4 === 0) task.batch_replies = true;
  if (i % 5 === 0) task.key = `session-${i % 7}`;
  if (i % 10 === 0) task.params.seed = 2n ** 63n - 1n; // the largest seed: a uint64
  if (i % 11 === 0) task.timeout_ms = 20000;
  return task;
}

function refusalCases(replyTo) {
  const base = (id, extra = {}) => ({ v: 1, t: MSG.TASK, id, prompt: "p", reply_to: replyTo, ...extra });
  // [frame, expected Result id, expected code, a part of the message]
  return [
    [base(""), "", "bad_request", "id"],
    [base("x".repeat(129)), "x".repeat(129), "bad_request", "id"],
    [base(EMOJI.repeat(129)), EMOJI.repeat(129), "bad_request", "id"],
    [base(5), "", "bad_request", "id"],
    [base("r-max-tokens", { params: { max_tokens: 0 } }), "r-max-tokens", "bad_request", "max_tokens"],
    [base("r-unknown-param", { params: { bogus: 1 } }), "r-unknown-param", "bad_request", "bogus"],
    [base("r-timeout", { timeout_ms: 0 }), "r-timeout", "bad_request", "timeout_ms"],
    [base("r-float-int", { params: { max_tokens: 2.5 } }), "r-float-int", "bad_request", "max_tokens"],
    [base("r-seed", { params: { seed: 2n ** 64n - 1n } }), "r-seed", "bad_request", "seed"],
    [base("r-producer-key", { producer_key: "short" }), "r-producer-key", "bad_request", "producer_key"],
    [base("r-version", { v: 2 }), "r-version", "unsupported_version", "version"],
    [{ v: 1, t: 9, id: "r-type", reply_to: replyTo }, "r-type", "bad_request", "6 (Tasks)"],
  ];
}

class Run {
  constructor(config) {
    this.config = config;
    this.failures = [];
    this.expect = new Map(); // id -> { kind, count: expected final Results, ... }
    this.results = new Map(); // id -> [Result, ...]
    this.chunks = new Map(); // id -> [Chunk, ...]
    this.stats = { messages: 0, multipart_messages: 0, replies_frames: 0, replies_items: 0, chunks: 0, results: 0, retries: 0, tasks_frames: 0, lone_frames: 0 };
    this.status = null;
    this.waiting = null;
  }

  fail(what) {
    if (this.failures.length < 50) this.failures.push(what);
  }

  async open() {
    const curve = this.config.curve;
    let pushOpts = {};
    let pullOpts = {};
    if (curve) {
      const daemon = readKeyFile(curve.server_key_file);
      const mine = readKeyFile(curve.key_file);
      // PUSH: client, server key = the daemon's; reply PULL: server, with the same key pair.
      pushOpts = { curveServerKey: daemon.publicKey, curvePublicKey: mine.publicKey, curveSecretKey: mine.secretKey };
      pullOpts = { curveServer: true, curvePublicKey: mine.publicKey, curveSecretKey: mine.secretKey };
    }
    this.pull = new Pull({ ...pullOpts, receiveHighWaterMark: 0 });
    await this.pull.bind("tcp://127.0.0.1:0");
    this.replyTo = this.pull.lastEndpoint;
    this.push = new Push({ ...pushOpts, sendHighWaterMark: 0, linger: 0 });
    this.push.connect(this.config.endpoint);
    this.reading = this.read();
  }

  async read() {
    for await (const message of this.pull) {
      this.stats.messages++;
      if (message.length !== 1) {
        this.stats.multipart_messages++;
        this.fail(`a ZeroMQ message of ${message.length} frames (PROTOCOL.md: one frame each)`);
      }
      for (const frame of message) this.onFrame(frame);
      if (this.waiting && this.waiting.done()) this.waiting.resolve();
    }
  }

  onFrame(frame) {
    let msg;
    try {
      msg = decode(frame, MSGPACK);
    } catch (err) {
      this.fail(`a frame that is not MessagePack: ${err}`);
      return;
    }
    if (msg.v !== 1) this.fail(`a reply with v=${msg.v}`);
    if (msg.t === MSG.REPLIES) {
      this.stats.replies_frames++;
      if (!Array.isArray(msg.items) || msg.items.length < 2) this.fail("a Replies frame of fewer than two items");
      for (const item of msg.items) {
        this.stats.replies_items++;
        if (item.t !== MSG.CHUNK && item.t !== MSG.RESULT) this.fail(`a Replies item of t=${item.t}`);
        else this.onReply(item, true);
      }
    } else if (msg.t === MSG.CHUNK || msg.t === MSG.RESULT) {
      this.onReply(msg, false);
    } else if (msg.t === MSG.STATUS_REPORT) {
      this.status = msg;
    } else {
      this.fail(`a reply of t=${msg.t}`);
    }
  }

  onReply(msg, packed) {
    const want = this.expect.get(msg.id);
    if (packed && want && !want.task?.batch_replies) this.fail(`${msg.id}: packed without batch_replies`);
    if (msg.t === MSG.CHUNK) {
      this.stats.chunks++;
      if ((this.results.get(msg.id) || []).length) this.fail(`${msg.id}: a Chunk after its Result`);
      if (!this.chunks.has(msg.id)) this.chunks.set(msg.id, []);
      this.chunks.get(msg.id).push(msg);
      return;
    }
    this.stats.results++;
    if (msg.ok === false && RETRIED.has(msg.error?.code) && want?.task) {
      // Not final: the same id again, attempt + 1, after retry_after_ms (PROTOCOL.md).
      this.stats.retries++;
      want.task.attempt = (want.task.attempt || 0) + 1;
      setTimeout(() => this.send(encode(want.task, MSGPACK), false), msg.error.retry_after_ms || 50);
      return;
    }
    if (!this.results.has(msg.id)) this.results.set(msg.id, []);
    this.results.get(msg.id).push(msg);
  }

  async send(frame, packed) {
    if (packed) this.stats.tasks_frames++;
    else this.stats.lone_frames++;
    await this.push.send(frame);
  }

  expectTask(task, kind) {
    this.expect.set(task.id, { kind, task, count: 1 });
  }

  // The mixed run: lone Task frames and Tasks frames of 2..24 items, interleaved.
  async mixed(n) {
    let i = 0;
    let pack = 0;
    for (let step = 0; i < n; step++) {
      const size = step % 3 === 0 ? 1 : Math.min(n - i, 2 + (pack % 23));
      const tasks = [];
      for (let k = 0; k < size; k++, i++) {
        const task = mixedTask(i, this.replyTo);
        this.expectTask(task, "mixed");
        tasks.push(task);
      }
      if (tasks.length === 1) {
        await this.send(encode(tasks[0], MSGPACK), false);
      } else {
        pack++;
        const frame = { v: 1, t: MSG.TASKS, id: `js-pack-${pack}`, reply_to: this.replyTo, items: tasks };
        await this.send(encode(frame, MSGPACK), true);
      }
    }
  }

  // Cancel packed with its task in one Tasks frame: the reliable form (PROTOCOL.md).
  async cancels(n) {
    for (let k = 0; k < n; k++) {
      const task = { v: 1, t: MSG.TASK, id: `js-cancel-${k}`, prompt: "never finished", reply_to: this.replyTo, stream: k % 2 === 0, params: { max_tokens: 32768 } };
      this.expectTask(task, "cancel");
      const frame = { v: 1, t: MSG.TASKS, items: [task, { v: 1, t: MSG.CANCEL, id: task.id }] };
      await this.send(encode(frame, MSGPACK), true);
    }
    // A Cancel for an id never seen: ignored, never answered.
    await this.send(encode({ v: 1, t: MSG.CANCEL, id: "js-never-sent" }, MSGPACK), false);
  }

  async refusals() {
    const cases = refusalCases(this.replyTo);
    for (const [frame, id, code, part] of cases) {
      const want = this.expect.get(id);
      if (want) want.count++;
      else this.expect.set(id, { kind: "refusal", code, part, count: 1 });
      await this.send(encode(frame, MSGPACK), false);
    }
    // A 128-emoji id (512 bytes, .length 256) is valid: limits count code points.
    const emoji = { v: 1, t: MSG.TASK, id: EMOJI.repeat(128), prompt: "smile", reply_to: this.replyTo, params: { max_tokens: 2 } };
    this.expectTask(emoji, "mixed");
    await this.send(encode(emoji, MSGPACK), false);
    // A bad item in a Tasks frame gets its own refusal; its neighbours run.
    const good = mixedTask(900001, this.replyTo);
    good.id = "js-beside-bad";
    this.expectTask(good, "mixed");
    this.expect.set("r-in-pack", { kind: "refusal", code: "bad_request", part: "max_tokens", count: 1 });
    const bad = { v: 1, t: MSG.TASK, id: "r-in-pack", prompt: "p", reply_to: this.replyTo, params: { max_tokens: 99999 } };
    await this.send(encode({ v: 1, t: MSG.TASKS, items: [bad, good] }, MSGPACK), true);
  }

  async statusQuery() {
    await this.send(encode({ v: 1, t: MSG.STATUS_QUERY, id: "js-status", reply_to: this.replyTo }, MSGPACK), false);
  }

  answered() {
    for (const [id, want] of this.expect) {
      if ((this.results.get(id) || []).length < want.count) return false;
    }
    return this.status !== null || !this.config.status;
  }

  async waitAnswered(timeoutMs) {
    if (this.answered()) return true;
    return await new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), timeoutMs);
      this.waiting = { done: () => this.answered(), resolve: () => { clearTimeout(timer); resolve(true); } };
    });
  }

  check() {
    for (const [id, want] of this.expect) {
      const got = this.results.get(id) || [];
      const label = id.length > 40 ? `${id.slice(0, 20)}...(${[...id].length} code points)` : id;
      if (got.length !== want.count) {
        this.fail(`${label}: ${got.length} final Results, expected ${want.count}`);
        continue;
      }
      const result = got[0];
      const chunks = this.chunks.get(id) || [];
      if (want.kind === "refusal") {
        for (const r of got) {
          if (r.ok !== false || r.error?.code !== want.code || !String(r.error?.message).includes(want.part)) {
            this.fail(`${label}: expected ${want.code} naming ${want.part}, got ${JSON.stringify(r.error)}`);
          }
        }
      } else if (want.kind === "cancel") {
        if (result.ok !== false || result.error?.code !== "cancelled") {
          this.fail(`${label}: expected cancelled, got ok=${result.ok} ${JSON.stringify(result.error)}`);
        }
      } else {
        const tokens = echoText(want.task.prompt, want.task.params.max_tokens);
        if (!result.ok) this.fail(`${label}: ${JSON.stringify(result.error)}`);
        else if (result.text !== tokens.join("")) this.fail(`${label}: text ${JSON.stringify(result.text)}, expected ${JSON.stringify(tokens.join(""))}`);
        if (result.attempts !== (want.task.attempt || 0) + 1) this.fail(`${label}: attempts ${result.attempts}`);
        for (const key of ["queued_ms", "first_token_ms", "total_ms"]) {
          if (typeof result.timings?.[key] !== "number") this.fail(`${label}: timings.${key} is not a number`);
        }
        if (want.task.stream) {
          const deltas = chunks.map((c) => c.delta);
          const seqs = chunks.map((c) => c.seq);
          if (result.chunks !== tokens.length || deltas.join("") !== result.text || JSON.stringify(deltas) !== JSON.stringify(tokens)) {
            this.fail(`${label}: chunks ${JSON.stringify(deltas)} (Result.chunks ${result.chunks}), expected one a word ${JSON.stringify(tokens)}`);
          }
          if (seqs.some((s, k) => s !== k)) this.fail(`${label}: seq ${JSON.stringify(seqs)}`);
        } else if (chunks.length || result.chunks !== 0) {
          this.fail(`${label}: Chunks for a task without stream`);
        }
      }
    }
    for (const id of this.results.keys()) {
      if (!this.expect.has(id)) this.fail(`a Result for an id never sent: ${id.slice(0, 40)}`);
    }
    const status = this.status;
    if (status && !(typeof status.checksum === "bigint" || Number.isInteger(status.checksum))) {
      this.fail(`StatusReport checksum ${typeof status.checksum}`);
    }
  }

  async close() {
    this.push.close();
    this.pull.close();
    await this.reading.catch(() => {});
  }
}

async function run(config) {
  const started = process.hrtime.bigint();
  const r = new Run(config);
  await r.open();
  if (config.status) await r.statusQuery();
  await r.refusals();
  await r.cancels(config.cancels ?? 20);
  await r.mixed(config.tasks ?? 2000);
  const sentAt = process.hrtime.bigint();
  const complete = await r.waitAnswered(config.timeout_ms ?? 60000);
  // Anything more (a second Result) would arrive right behind the first: look for it.
  await new Promise((resolve) => setTimeout(resolve, 300));
  r.check();
  if (!complete) r.fail("not every message was answered before the timeout");
  await r.close();
  const finished = process.hrtime.bigint();
  const kinds = {};
  for (const want of r.expect.values()) kinds[want.kind] = (kinds[want.kind] || 0) + 1;
  const answeredOnce = [...r.expect].filter(([id, w]) => (r.results.get(id) || []).length === w.count).length;
  return {
    ok: r.failures.length === 0,
    failures: r.failures,
    curve: Boolean(config.curve),
    expected: Object.fromEntries(Object.entries(kinds)),
    ids: r.expect.size,
    answered_exactly_as_expected: answeredOnce,
    ...r.stats,
    status: r.status && { node: r.status.node, status: r.status.status, checksum: String(r.status.checksum), checksum_type: typeof r.status.checksum },
    send_s: Number(sentAt - started) / 1e9,
    total_s: Number(finished - started) / 1e9,
    node: process.version,
  };
}

const [mode, ...args] = process.argv.slice(2);
if (mode === "keygen") {
  console.log(JSON.stringify({ public_key: writeKeyFiles(args[0], args[1]) }));
} else if (mode === "run") {
  const report = await run(JSON.parse(args[0]));
  console.log(JSON.stringify(report));
  process.exitCode = report.ok ? 0 : 1;
} else {
  console.error("usage: node producer.mjs keygen DIR NAME | run CONFIG_JSON");
  process.exitCode = 2;
}
