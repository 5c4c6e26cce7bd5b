// The peer side of the e2e benchmark's `peers` scenario (benches/e2e/peers.rs):
// graphile-worker run in this Node.js process against the scenario's scratch
// database, reporting to the bench on stdout, one line per fact.
//
//   node worker.js migrate
//       Install graphile-worker's schema (runMigrations), print `migrated`, exit.
//   node worker.js drain <default|tuned> <jobs>
//       Run a no-op task `noop`; print `starting` just before the worker
//       starts, `ready <now>` once it runs, and `ran <jobs>` when the task
//       has started <jobs> times.
//   node worker.js latency <default|tuned>
//       Print `ready <now>` once the worker runs; then run the task `probe`,
//       which prints `<t> <w> <start>` for each job on
//       entry: `t` and `w` from the job's payload (`data.t`, the bench's
//       monotonic send time, and `data.w`, its wall-clock send time in
//       microseconds since the Unix epoch), `start` the wall-clock time the
//       task started, microseconds since the Unix epoch
//       (performance.timeOrigin + performance.now(), the same clock as `w` on
//       one machine, at microsecond resolution). `<now>` in `ready` is that
//       clock too, for the bench to check it against its own.
//
// The connection comes from libpq's variables (PGHOST, PGPORT, PGUSER,
// PGPASSWORD, PGDATABASE, PGSSLMODE), which node-postgres reads; the bench
// clears DATABASE_URL. The worker stops (gracefully, then the process exits
// 0) when stdin closes, so it never outlives the bench. Graphile Worker's
// log goes to stderr; stdout carries only the lines above.

"use strict";

const { performance } = require("node:perf_hooks");
const { run, runMigrations, Logger } = require("graphile-worker");

// Configurations. `default` sets nothing: graphile-worker's defaults
// (concurrentJobs 1, maxPoolSize 10, no local queue, no batched completion).
// `tuned` is the configuration of the "Quick stats" on
// https://worker.graphile.org/docs/performance (concurrentJobs 24,
// maxPoolSize 25, localQueue.size 500, completeJobBatchDelay 0,
// failJobBatchDelay 0), the page's high-throughput setup; its "Batching"
// section documents localQueue and the batch delays.
const CONFIGS = {
  default: {},
  tuned: {
    concurrentJobs: 24,
    maxPoolSize: 25,
    localQueue: { size: 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
  },
};

const logger = new Logger((scope) => (level, message) => {
  // Debug and info lines would cost time per job; warnings and errors matter.
  if (level === "error" || level === "warning") {
    process.stderr.write(`graphile-worker ${level}: ${message}\n`);
  }
});

function out(line) {
  process.stdout.write(line + "\n");
}

function fail(message) {
  process.stderr.write(`worker.js: ${message}\n`);
  process.exit(2);
}

function wallMicros() {
  return Math.round((performance.timeOrigin + performance.now()) * 1000);
}

async function main() {
  const [mode, configName, jobsArg] = process.argv.slice(2);
  if (mode === "migrate") {
    await runMigrations({ logger });
    out("migrated");
    return;
  }
  const config = CONFIGS[configName];
  if (mode !== "drain" && mode !== "latency") {
    fail(`unknown mode ${JSON.stringify(mode)}; expected migrate, drain or latency`);
  }
  if (!config) {
    fail(`unknown configuration ${JSON.stringify(configName)}; expected default or tuned`);
  }
  let taskList;
  if (mode === "drain") {
    const jobs = Number(jobsArg);
    if (!Number.isSafeInteger(jobs) || jobs < 1) {
      fail(`drain needs a job count >= 1, got ${JSON.stringify(jobsArg)}`);
    }
    let ran = 0;
    taskList = {
      noop: async () => {
        ran += 1;
        if (ran === jobs) {
          out(`ran ${jobs}`);
        }
      },
    };
  } else {
    taskList = {
      probe: async (payload) => {
        const start = wallMicros();
        const data = (payload && payload.data) || {};
        out(`${data.t} ${data.w} ${start}`);
      },
    };
  }
  out("starting");
  const runner = await run({
    logger,
    taskList,
    noHandleSignals: true,
    preset: { worker: config },
  });
  out(`ready ${wallMicros()}`);
  let stopping = false;
  const stop = () => {
    if (stopping) return;
    stopping = true;
    runner.stop().catch((e) => fail(`stopping the worker: ${e && e.stack}`));
  };
  process.stdin.on("end", stop);
  process.stdin.on("error", stop);
  process.stdin.resume();
  await runner.promise;
}

main().then(
  () => process.exit(0),
  (e) => fail(e && e.stack ? e.stack : String(e)),
);
