//! Ownership: what a consumer of the listen source may fetch, by mode
//! (competing mode owns nothing: `super::claim`).
//!
//! - Single: one active consumer per outbox, the holder of a session
//!   advisory lock on its work session; the others are standbys that try to
//!   take it every [`LOCK_INTERVAL`], and look every few seconds whether
//!   its holder is a live relay ([`super::stranded`]). The active consumer
//!   registers in `events.outbox_relays` as soon as it takes the lock: its
//!   first heartbeat.
//! - Partitioned: each consumer holds a membership lock; partitions (a hash
//!   of the aggregate) are held through one advisory lock each, taken or
//!   given up every few [`LOCK_INTERVAL`]s to a fair share of the members.
//!   A partition given up is unlocked only once nothing of it is in flight,
//!   so per-aggregate order holds across the hand-over.
//!
//! Every lock belongs to the work session: when it is lost, ownership is
//! gone with it. The lock keys are listed in docs/architecture.md,
//! "Advisory lock keys" (PostgreSQL docs, "Advisory Locks").

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::stranded::{Found, Watch};
use super::{Cx, jittered};
use crate::consumer::health::Role;
use crate::consumer::lease::TAKEOVER_WAIT;
use crate::consumer::{ConsumerConfig, Mode};
use crate::metrics as m;
use crate::store::FetchScope;
use crate::store::statement::StatementError;

/// How often a standby tries to take over (and, times four, how often
/// partitions are rebalanced): 250 ms.
pub(super) const LOCK_INTERVAL: Duration = Duration::from_millis(250);

/// Partitioned mode's state.
#[derive(Debug, Default)]
pub(super) struct Partitions {
    partitions: u32,
    /// This session's membership key.
    member_key: i32,
    owned: BTreeSet<i32>,
    /// Given up, unlocked once nothing of them is in flight.
    releasing: BTreeSet<i32>,
    /// Partition of every fetched, not yet written id.
    part_of: HashMap<i64, i32>,
    lock_at: Option<Instant>,
}

/// Ownership by mode: each variant holds only its mode's state.
#[derive(Debug)]
pub(super) enum Ownership {
    Single {
        leader: bool,
        /// The leadership term taken with the lock (`events.outbox_terms`).
        term: Option<i64>,
        /// The last term this consumer took, kept when it loses its
        /// session: taking the outbox back from itself needs no wait.
        last_term: Option<i64>,
        /// After taking over from a holder that did not release its term:
        /// no fetch before this ([`TAKEOVER_WAIT`]). Kept when the session
        /// is lost, so a wait cut short by a lost session is waited out
        /// when the outbox is taken back.
        waits_until: Option<Instant>,
        standby_logged: bool,
        lock_at: Option<Instant>,
        watch: Box<Watch>,
    },
    Partitioned(Partitions),
}

impl Ownership {
    /// Nothing owned yet, for `cfg`'s mode (competing mode is taken for
    /// single: it is not the listen source's).
    pub(super) fn new(cfg: &ConsumerConfig) -> Self {
        match cfg.mode {
            Mode::Partitioned { partitions } => Ownership::Partitioned(Partitions { partitions, ..Default::default() }),
            _ => Ownership::Single {
                leader: false,
                term: None,
                last_term: None,
                waits_until: None,
                standby_logged: false,
                lock_at: None,
                watch: Box::new(Watch::new(cfg)),
            },
        }
    }

    /// May this consumer fetch now?
    pub(super) fn may_fetch(&self) -> bool {
        match self {
            Ownership::Single { leader, waits_until, .. } => *leader && waits_until.is_none_or(|t| Instant::now() >= t),
            Ownership::Partitioned(p) => !p.owned.is_empty(),
        }
    }

    /// The leadership term held now (single mode's leader; `None` for a
    /// standby and in partitioned mode).
    pub(super) fn term(&self) -> Option<i64> {
        match self {
            Ownership::Single { leader: true, term, .. } => *term,
            _ => None,
        }
    }

    /// The term this leader may mark released at a graceful stop: its own,
    /// once any wait after its takeover is over (a leader still waiting out
    /// a deposed predecessor's lease must pass that wait on to the next).
    pub(super) fn releasable_term(&self) -> Option<i64> {
        match self {
            Ownership::Single { leader: true, term, waits_until, .. }
                if waits_until.is_none_or(|t| Instant::now() >= t) =>
            {
                *term
            }
            _ => None,
        }
    }

    /// What this consumer does now, for its health.
    pub(super) fn role(&self) -> Role {
        match self {
            Ownership::Single { leader: true, .. } => Role::Leader,
            Ownership::Single { .. } => Role::Standby,
            Ownership::Partitioned(p) => {
                Role::Partitioned { held: p.owned.iter().map(|k| k.unsigned_abs()).collect(), partitions: p.partitions }
            }
        }
    }

    /// Partitioned mode: fetched rows carry their partition.
    pub(super) fn is_partitioned(&self) -> bool {
        matches!(self, Ownership::Partitioned(_))
    }

    /// When to try to take (or rebalance) locks next.
    pub(super) fn lock_at(&self) -> Option<Instant> {
        match self {
            Ownership::Single { lock_at, .. } => *lock_at,
            Ownership::Partitioned(p) => p.lock_at,
        }
    }

    /// New sessions are open: nothing is owned, locks are taken at once;
    /// in partitioned mode the work session first takes a membership lock
    /// with a key drawn anew.
    pub(super) async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
        self.session_lost();
        match self {
            Ownership::Single { standby_logged, lock_at, watch, .. } => {
                *standby_logged = false;
                *lock_at = Some(Instant::now());
                watch.reset();
            }
            Ownership::Partitioned(p) => {
                p.member_key = rand::random::<i32>();
                cx.work.take_member_lock(p.member_key, cx.stop()).await?;
                p.lock_at = Some(Instant::now());
            }
        }
        Ok(())
    }

    /// The work session is gone, and its locks with it.
    pub(super) fn session_lost(&mut self) {
        match self {
            Ownership::Single { watch, .. } => {
                watch.reset();
                self.set_leader(false);
            }
            Ownership::Partitioned(p) => {
                p.owned.clear();
                p.releasing.clear();
            }
        }
        metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
    }

    fn set_leader(&mut self, now: bool) {
        let Ownership::Single { leader, term, waits_until, .. } = self else { return };
        if now && !*leader {
            match waits_until.filter(|t| *t > Instant::now()) {
                None => tracing::info!(
                    role = "leader",
                    term = term.unwrap_or(0),
                    "active: this consumer holds the outbox lock and delivers"
                ),
                Some(until) => tracing::info!(role = "leader", term = term.unwrap_or(0),
                    wait = ?until.saturating_duration_since(Instant::now()),
                    "active: this consumer holds the outbox lock; the previous leader did not release its term \
                     (it crashed, froze or lost its connection), so delivery starts once its hand-out lease has \
                     run out"),
            }
        } else if !now && *leader {
            tracing::warn!(role = "standby", "no longer active (connection lost); will try to take over again");
        }
        if !now {
            *term = None;
        }
        metrics::gauge!(m::LEADER).set(if now { 1.0 } else { 0.0 });
        metrics::gauge!(m::LEADER_TERM).set(term.filter(|_| now).unwrap_or(0) as f64);
        *leader = now;
    }

    /// The partitions held, for the scope of a fetch (`None` in single mode).
    pub(super) fn partitions(&self) -> Option<(u32, Vec<i32>)> {
        match self {
            Ownership::Single { .. } => None,
            Ownership::Partitioned(p) => Some((p.partitions, p.owned.iter().copied().collect())),
        }
    }

    /// A fetch's scope, given [`Self::partitions`].
    pub(super) fn scope(partitions: &Option<(u32, Vec<i32>)>) -> FetchScope<'_> {
        match partitions {
            None => FetchScope::All,
            Some((partitions, owned)) => FetchScope::Partitions { partitions: *partitions, owned },
        }
    }

    /// Event `id` of partition `partition` was fetched.
    pub(super) fn fetched(&mut self, id: i64, partition: Option<i32>) {
        if let (Ownership::Partitioned(p), Some(part)) = (self, partition) {
            p.part_of.insert(id, part);
        }
    }

    /// Event `id` is no longer in flight (written, or released).
    pub(super) fn done(&mut self, id: i64) {
        if let Ownership::Partitioned(p) = self {
            p.part_of.remove(&id);
        }
    }

    /// Take the outbox lock (single mode) or rebalance partitions. `Ok(true)`:
    /// this consumer owns more than before and should fetch.
    pub(super) async fn take_locks(&mut self, cx: Cx<'_>) -> Result<bool, StatementError> {
        match self {
            Ownership::Single { leader: true, lock_at, waits_until, .. } => {
                *lock_at = None;
                // The wait after a takeover ended: fetch now.
                Ok(waits_until.take().is_some())
            }
            Ownership::Single { .. } => self.try_lead(cx).await,
            Ownership::Partitioned(p) => {
                p.lock_at = None;
                let gained = p.rebalance(cx).await?;
                p.lock_at = Some(Instant::now() + jittered(LOCK_INTERVAL * 4));
                Ok(gained)
            }
        }
    }

    async fn try_lead(&mut self, cx: Cx<'_>) -> Result<bool, StatementError> {
        if let Ownership::Single { lock_at, .. } = self {
            *lock_at = None;
        }
        if cx.work.try_leader_lock(cx.stop()).await? {
            // The first heartbeat and the next term, before anything else:
            // standbys and `status` see a live holder from now on, and
            // writes under an older term change nothing.
            let taken = cx.work.take_term(cx.stop()).await?;
            if let Ownership::Single { watch, term, last_term, waits_until, lock_at, .. } = self {
                watch.reset();
                let now = Instant::now();
                // A wait this consumer had not finished when it lost its
                // session still runs.
                let inherited = waits_until.filter(|t| *t > now);
                // Taken back from itself (no other leader since): its own
                // buffer was dropped with the session, nothing to wait for.
                let own = taken.previous_term.is_some() && taken.previous_term == *last_term;
                *waits_until = if taken.previous_released || own { inherited } else { Some(now + TAKEOVER_WAIT) };
                *term = Some(taken.term);
                *last_term = Some(taken.term);
                *lock_at = *waits_until;
                if own {
                    tracing::info!(
                        term = taken.term,
                        "took the outbox back after losing the session (no other leader since)"
                    );
                }
            }
            self.set_leader(true);
            return Ok(true);
        }
        metrics::gauge!(m::LEADER).set(0.0);
        let Ownership::Single { standby_logged, lock_at, watch, .. } = self else { return Ok(false) };
        if !*standby_logged {
            *standby_logged = true;
            tracing::info!(role = "standby", "standby: another consumer holds the outbox lock; waiting to take over");
        }
        let now = Instant::now();
        *lock_at = Some(now + LOCK_INTERVAL);
        if watch.due(now) && watch.look(cx).await? == Found::Ended {
            // Its backend ends in a moment, and the lock with it.
            *lock_at = Some(Instant::now());
        }
        Ok(false)
    }
}

impl Partitions {
    /// Take partitions up to a fair share of the members, give up any over
    /// it, and unlock given-up partitions with nothing in flight.
    /// `Ok(true)`: more partitions are owned than before.
    async fn rebalance(&mut self, cx: Cx<'_>) -> Result<bool, StatementError> {
        let members = cx.work.count_members(cx.stop()).await?;
        let members = u32::try_from(members.max(1)).unwrap_or(1);
        let share = self.partitions.div_ceil(members) as usize;
        let before = self.owned.len();
        if self.owned.len() < share {
            self.take_share(cx, share).await?;
        }
        while self.owned.len() > share {
            if let Some(p) = self.owned.pop_last() {
                self.releasing.insert(p);
            }
        }
        let busy: BTreeSet<i32> = self.part_of.values().copied().collect();
        let free: Vec<i32> = self.releasing.iter().copied().filter(|p| !busy.contains(p)).collect();
        for p in free {
            cx.work.unlock_partition(p, cx.stop()).await?;
            self.releasing.remove(&p);
        }
        if self.owned.len() == before {
            return Ok(false);
        }
        tracing::info!(role = "partitioned", owned = ?self.owned, members, "partitions rebalanced");
        metrics::gauge!(m::PARTITIONS_OWNED).set(self.owned.len() as f64);
        Ok(self.owned.len() > before)
    }

    /// Try the partitions in turn, starting at one given by this session's
    /// member key, until `share` are held.
    async fn take_share(&mut self, cx: Cx<'_>, share: usize) -> Result<(), StatementError> {
        let start = (self.member_key.unsigned_abs() % self.partitions.max(1)) as i32;
        let total = i32::try_from(self.partitions).unwrap_or(i32::MAX);
        for k in 0..total {
            if self.owned.len() >= share {
                break;
            }
            let p = (start + k) % total;
            if self.owned.contains(&p) || self.releasing.contains(&p) {
                continue;
            }
            if cx.work.try_partition_lock(p, cx.stop()).await? {
                self.owned.insert(p);
            }
        }
        Ok(())
    }
}
