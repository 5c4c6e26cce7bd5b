//! CPU pinning for the producers' comparison of the `subscriptions`
//! scenario: producers (this process's threads but the drains' runtime,
//! and their server processes) on one CPU, the subscriptions' Consumers
//! (a runtime of their own and their server processes) on another, so the
//! comparison shows what the drains cost the producers through the
//! database (WAL, locks, buffers) rather than through a shared CPU
//! (`sched_setaffinity(2)`; Linux only, and only with at least two CPUs and
//! the right to pin the server's processes: otherwise the pinned variant is
//! skipped and says so).

use pg_outbox::tokio_postgres::Client;

/// The name the drains' runtime gives its threads.
pub const DRAINS_THREAD: &str = "pgo-drains";

/// The CPU of the producers and the CPU of the drains.
pub const PRODUCERS_CPU: usize = 0;
/// See [`PRODUCERS_CPU`].
pub const DRAINS_CPU: usize = 1;

/// Whether pinning can be tried here: at least two CPUs this process may
/// run on.
pub fn available() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
}

/// Pin task or process `pid` (0: the calling thread) to the CPUs `cpus`;
/// whether the kernel took it.
pub fn pin(pid: i32, cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it
    // for CPUs below CPU_SETSIZE, and sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &cpu in cpus {
            libc::CPU_SET(cpu, &mut set);
        }
        libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Pin every thread of this process to [`PRODUCERS_CPU`] but the drains'
/// runtime's ([`DRAINS_THREAD`], pinned as they start); with `all`, every
/// thread back to both CPUs. Whether every thread was pinned.
pub fn pin_own_threads(all: bool) -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return false };
    let mut ok = true;
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else { continue };
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        ok &= if all {
            pin(tid, &[PRODUCERS_CPU, DRAINS_CPU])
        } else if comm.trim().starts_with(DRAINS_THREAD) {
            true
        } else {
            pin(tid, &[PRODUCERS_CPU])
        };
    }
    ok
}

/// Pin the server processes of this database: the Consumers' (their
/// `application_name` starts with `pg-outbox`) to [`DRAINS_CPU`], every
/// other client's (the producers', the samplers') to [`PRODUCERS_CPU`].
/// How many were pinned, or `None` when one could not be (another
/// machine's server, or no right to).
pub async fn pin_backends(client: &Client) -> Option<usize> {
    let rows = client
        .query(
            "SELECT pid, coalesce(application_name, '') LIKE 'pg-outbox%' FROM pg_stat_activity \
             WHERE datname = current_database() AND backend_type = 'client backend'",
            &[],
        )
        .await
        .ok()?;
    let mut n = 0;
    for row in rows {
        let (pid, drain): (i32, bool) = (row.get(0), row.get(1));
        if !pin(pid, &[if drain { DRAINS_CPU } else { PRODUCERS_CPU }]) {
            return None;
        }
        n += 1;
    }
    Some(n)
}
