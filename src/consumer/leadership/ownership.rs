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
//!   so per-aggregate order holds across the hand-over. Each partition has
//!   its own leadership term (scope `partition:P/N`), taken with its lock
//!   and released when it is given up or the consumer stops; a partition
//!   taken from a holder that did not release it is fetched only after
//!   [`TAKEOVER_WAIT`], as single mode's outbox is.
//!
//! Every lock belongs to the work session: when it is lost, ownership is
//! gone with it. The lock keys are listed in docs/architecture.md,
//! "Advisory lock keys" (PostgreSQL docs, "Advisory Locks").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use super::lease::{TAKEOVER_WAIT, taking_leadership};
use super::stranded::{Found, Watch};
use crate::consumer::cx::{Cx, jittered};
use crate::consumer::health::Role;
use crate::consumer::{ConsumerConfig, Mode};
use crate::metrics as m;
use crate::store::leader::TermTaken;
use crate::store::statement::StatementError;
use crate::store::{Fence, FetchPage, FetchScope};
use crate::term::Term;

/// How often a standby tries to take over (and, times four, how often
/// partitions are rebalanced): 250 ms.
pub(in crate::consumer) const LOCK_INTERVAL: Duration = Duration::from_millis(250);

/// Partitioned mode's state.
#[derive(Debug, Default)]
pub(in crate::consumer) struct Partitions {
    partitions: u32,
    /// What the scope of each partition's term starts with
    /// ([`crate::store::subscription::Reader::partition_scope_prefix`]).
    scope_prefix: String,
    /// This session's membership key.
    member_key: i32,
    owned: BTreeSet<i32>,
    /// Given up, unlocked once nothing of them is in flight.
    releasing: BTreeSet<i32>,
    /// The term held of every partition owned or releasing.
    terms: BTreeMap<i32, Term>,
    /// The last term this consumer took of each partition, kept when it
    /// loses its session (taking a partition back from itself needs no
    /// wait).
    last_terms: BTreeMap<i32, Term>,
    /// Partitions taken over from a holder that did not release them: not
    /// fetched before these instants ([`TAKEOVER_WAIT`]). Kept when the
    /// session is lost, as single mode's wait is.
    waits: BTreeMap<i32, Instant>,
    /// Partition, and the term it was fetched under, of every fetched, not
    /// yet written id.
    part_of: HashMap<i64, (i32, Option<Term>)>,
    lock_at: Option<Instant>,
}

/// Ownership by mode: each variant holds only its mode's state.
#[derive(Debug)]
pub(in crate::consumer) enum Ownership {
    Single {
        /// The scope of its term in `events.outbox_terms`: `outbox`, or a
        /// named subscription's `subscription:NAME`
        /// ([`crate::store::subscription::Reader::leader_scope`]).
        scope: String,
        leader: bool,
        /// The leadership term taken with the lock (`events.outbox_terms`).
        term: Option<Term>,
        /// The last term this consumer took, kept when it loses its
        /// session: taking the outbox back from itself needs no wait.
        last_term: Option<Term>,
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
    pub(in crate::consumer) fn new(cfg: &ConsumerConfig) -> Self {
        match cfg.mode {
            Mode::Partitioned { partitions } => Ownership::Partitioned(Partitions {
                partitions,
                scope_prefix: cfg.reader.partition_scope_prefix(),
                ..Default::default()
            }),
            _ => Ownership::Single {
                scope: cfg.reader.leader_scope(),
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
    pub(in crate::consumer) fn may_fetch(&self) -> bool {
        match self {
            Ownership::Single { leader, waits_until, .. } => *leader && waits_until.is_none_or(|t| Instant::now() >= t),
            Ownership::Partitioned(p) => p.fetchable().next().is_some(),
        }
    }

    /// Does this consumer hold a leadership term now (single mode's leader,
    /// a partitioned consumer holding a partition)? Then its fetches must
    /// find its terms current, and its hand-outs are bound by the lease.
    pub(in crate::consumer) fn fenced(&self) -> bool {
        match self {
            Ownership::Single { leader, term, .. } => *leader && term.is_some(),
            Ownership::Partitioned(p) => !p.terms.is_empty(),
        }
    }

    /// What a fetch's rows say of the terms held: each row carries the
    /// current term of its scope as the fetch read it.
    pub(in crate::consumer) fn check_page(&self, page: &FetchPage) -> TermCheck {
        if !self.fenced() {
            return TermCheck::Unfenced;
        }
        match self {
            Ownership::Single { term: Some(held), .. } => match page.term {
                None if page.rows.is_empty() => TermCheck::Unconfirmed,
                current if current == Some(*held) => TermCheck::Confirmed,
                current => TermCheck::Superseded { term: Some(*held), current },
            },
            Ownership::Single { .. } => TermCheck::Unfenced,
            Ownership::Partitioned(p) => {
                let mut any = false;
                for row in page.rows.iter().flatten() {
                    any = true;
                    let held = row.partition.and_then(|part| p.terms.get(&part).copied());
                    if held.is_none() || held != row.term {
                        return TermCheck::Superseded { term: held, current: row.term };
                    }
                }
                if any { TermCheck::Confirmed } else { TermCheck::Unconfirmed }
            }
        }
    }

    /// Confirm with one statement that every term held is still current
    /// (the hand-out lease ran out while deliveries wait).
    pub(in crate::consumer) async fn confirm_terms(&self, cx: Cx<'_>) -> Result<TermCheck, StatementError> {
        match self {
            Ownership::Single { leader: true, term: Some(held), scope, .. } => {
                let current = cx.work.current_term(scope, cx.stop()).await?;
                Ok(if current == Some(*held) {
                    TermCheck::Confirmed
                } else {
                    TermCheck::Superseded { term: Some(*held), current }
                })
            }
            Ownership::Partitioned(p) if !p.terms.is_empty() => {
                let scopes: Vec<String> = p.terms.keys().map(|part| p.scope(*part)).collect();
                let current = cx.work.current_terms(&scopes, cx.stop()).await?;
                for (part, held) in &p.terms {
                    let now = current.get(&p.scope(*part)).copied();
                    if now != Some(*held) {
                        return Ok(TermCheck::Superseded { term: Some(*held), current: now });
                    }
                }
                Ok(TermCheck::Confirmed)
            }
            _ => Ok(TermCheck::Unfenced),
        }
    }

    /// The terms a write of the settlements of `ids` is conditional on:
    /// single mode's last term; in partitioned mode, per partition of those
    /// ids, the term held now if this consumer holds the partition (it may
    /// have taken it back), else the one the event was fetched under.
    /// `None`: nothing to fence (no term was ever taken).
    pub(in crate::consumer) fn fence_for(&self, ids: &[i64]) -> Option<Fence> {
        match self {
            Ownership::Single { last_term, scope, .. } => last_term.map(|t| Fence::of(scope, t)),
            Ownership::Partitioned(p) => {
                let mut fence = Fence::default();
                for (part, fetched) in ids.iter().filter_map(|id| p.part_of.get(id)) {
                    let term = p.terms.get(part).copied().or(*fetched);
                    fence.insert(p.scope(*part), term);
                }
                (!fence.is_empty()).then_some(fence)
            }
        }
    }

    /// The terms this consumer may mark released at a graceful stop, scope
    /// and term: single mode's leader's, and every partition's held, once
    /// any wait after its takeover is over (a holder still waiting out a
    /// deposed predecessor's lease must pass that wait on to the next).
    pub(in crate::consumer) fn releasable_terms(&self) -> Vec<(String, Term)> {
        let now = Instant::now();
        match self {
            Ownership::Single { leader: true, term: Some(term), waits_until, scope, .. }
                if waits_until.is_none_or(|t| now >= t) =>
            {
                vec![(scope.clone(), *term)]
            }
            Ownership::Single { .. } => Vec::new(),
            Ownership::Partitioned(p) => p
                .terms
                .iter()
                .filter(|(part, _)| p.waits.get(part).is_none_or(|t| now >= *t))
                .map(|(part, term)| (p.scope(*part), *term))
                .collect(),
        }
    }

    /// What this consumer does now, for its health.
    pub(in crate::consumer) fn role(&self) -> Role {
        match self {
            Ownership::Single { leader: true, .. } => Role::Leader,
            Ownership::Single { .. } => Role::Standby,
            Ownership::Partitioned(p) => {
                Role::Partitioned { held: p.owned.iter().map(|k| k.unsigned_abs()).collect(), partitions: p.partitions }
            }
        }
    }

    /// Single mode: `Some(true)` when a try for the outbox lock since the
    /// sessions opened found another holding it, `Some(false)` when this
    /// consumer leads, `None` before its first try; partitioned mode:
    /// `Some(false)`.
    #[cfg(feature = "wal")]
    pub(in crate::consumer) fn stands_by(&self) -> Option<bool> {
        match self {
            Ownership::Single { leader: true, .. } | Ownership::Partitioned(_) => Some(false),
            Ownership::Single { standby_logged: true, .. } => Some(true),
            Ownership::Single { .. } => None,
        }
    }

    /// Partitioned mode: fetched rows carry their partition.
    pub(in crate::consumer) fn is_partitioned(&self) -> bool {
        matches!(self, Ownership::Partitioned(_))
    }

    /// When to try to take (or rebalance) locks next, or a wait after a
    /// partition's takeover ends.
    pub(in crate::consumer) fn lock_at(&self) -> Option<Instant> {
        match self {
            Ownership::Single { lock_at, .. } => *lock_at,
            Ownership::Partitioned(p) => {
                let wait = p.waits.iter().filter(|(part, _)| p.owned.contains(part)).map(|(_, t)| *t).min();
                match (p.lock_at, wait) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
        }
    }

    /// New sessions are open: nothing is owned, locks are taken at once;
    /// in partitioned mode the work session first takes a membership lock
    /// with a key drawn anew.
    pub(in crate::consumer) async fn session_opened(&mut self, cx: Cx<'_>) -> Result<(), StatementError> {
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
                taking_leadership(cx).await?;
                p.lock_at = Some(Instant::now());
            }
        }
        Ok(())
    }

    /// The work session is gone, and its locks with it.
    pub(in crate::consumer) fn session_lost(&mut self) {
        match self {
            Ownership::Single { watch, .. } => {
                watch.reset();
                self.set_leader(false, None);
            }
            Ownership::Partitioned(p) => {
                if !p.terms.is_empty() {
                    let held: Vec<String> = p.terms.iter().map(|(part, t)| format!("{part} (term {t})")).collect();
                    tracing::warn!(partitions = %held.join(", "),
                        "no longer holding partitions {} (connection lost): their terms are this relay's no more, \
                         another relay may take them; will rebalance", held.join(", "));
                }
                p.owned.clear();
                p.releasing.clear();
                p.terms.clear();
            }
        }
        crate::metrics::gauge!(m::PARTITIONS_OWNED).set(0.0);
    }

    /// Lead now or no more; `ended`: the term the taking of the lock ended
    /// (logged).
    fn set_leader(&mut self, now: bool, ended: Option<Term>) {
        let Ownership::Single { leader, term, waits_until, .. } = self else { return };
        let ended = ended.map(Term::get);
        if now && !*leader {
            match waits_until.filter(|t| *t > Instant::now()) {
                None => tracing::info!(
                    signal = "leader",
                    role = "leader",
                    term = term.map_or(0, Term::get),
                    ended_term = ended,
                    "active: this consumer holds the outbox lock and delivers"
                ),
                Some(until) => {
                    tracing::info!(signal = "leader", role = "leader", term = term.map_or(0, Term::get), ended_term = ended,
                    wait = ?until.saturating_duration_since(Instant::now()),
                    "active: this consumer holds the outbox lock; the previous leader did not release its term \
                     (it crashed, froze or lost its connection), so delivery starts once its hand-out lease has \
                     run out")
                }
            }
        } else if !now && *leader {
            tracing::warn!(
                signal = "deposed",
                role = "standby",
                term = term.map_or(0, Term::get),
                "no longer active (connection lost): term {} is this relay's no more (another relay may have taken a \
                 later one since); will try to take over again",
                term.map_or(0, Term::get)
            );
        }
        if !now {
            *term = None;
        }
        crate::metrics::gauge!(m::LEADER).set(if now { 1.0 } else { 0.0 });
        crate::metrics::gauge!(m::LEADER_TERM).set(term.filter(|_| now).map_or(0, Term::get) as f64);
        *leader = now;
    }

    /// The partitions held and not waiting out a takeover, for the scope of
    /// a fetch (`None` in single mode).
    pub(in crate::consumer) fn partitions(&self) -> Option<(u32, Vec<i32>)> {
        match self {
            Ownership::Single { .. } => None,
            Ownership::Partitioned(p) => Some((p.partitions, p.fetchable().collect())),
        }
    }

    /// A fetch's scope, given [`Self::partitions`].
    pub(in crate::consumer) fn scope(partitions: &Option<(u32, Vec<i32>)>) -> FetchScope<'_> {
        match partitions {
            None => FetchScope::All,
            Some((partitions, owned)) => FetchScope::Partitions { partitions: *partitions, owned },
        }
    }

    /// Event `id` of partition `partition` was fetched (under the term held
    /// of that partition).
    pub(in crate::consumer) fn fetched(&mut self, id: i64, partition: Option<i32>) {
        if let (Ownership::Partitioned(p), Some(part)) = (self, partition) {
            let term = p.terms.get(&part).copied();
            p.part_of.insert(id, (part, term));
        }
    }

    /// Event `id` is no longer in flight (written, or released).
    pub(in crate::consumer) fn done(&mut self, id: i64) {
        if let Ownership::Partitioned(p) = self {
            p.part_of.remove(&id);
        }
    }

    /// Take the outbox lock (single mode) or rebalance partitions. `Ok(true)`:
    /// this consumer owns more than before and should fetch.
    pub(in crate::consumer) async fn take_locks(&mut self, cx: Cx<'_>) -> Result<bool, StatementError> {
        match self {
            Ownership::Single { leader: true, lock_at, waits_until, .. } => {
                *lock_at = None;
                // The wait after a takeover ended: fetch now.
                Ok(waits_until.take().is_some())
            }
            Ownership::Single { .. } => self.try_lead(cx).await,
            Ownership::Partitioned(p) => {
                let now = Instant::now();
                let before = p.waits.len();
                p.waits.retain(|_, t| *t > now);
                let waited = p.waits.len() < before;
                if p.lock_at.is_none_or(|t| t > now) {
                    return Ok(waited);
                }
                p.lock_at = None;
                let gained = p.rebalance(cx).await?;
                p.lock_at = Some(Instant::now() + jittered(LOCK_INTERVAL * 4));
                Ok(gained || waited)
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
            let (scope, seen) = match self {
                Ownership::Single { last_term, scope, .. } => (scope.clone(), *last_term),
                Ownership::Partitioned(_) => (crate::store::leader::OUTBOX_SCOPE.to_string(), None),
            };
            let taken = cx.work.take_term(&scope, cx.stop()).await?;
            let taken = above_seen(cx, &scope, taken, seen).await?;
            taking_leadership(cx).await?;
            if let Ownership::Single { watch, term, last_term, waits_until, lock_at, .. } = self {
                watch.reset();
                let now = Instant::now();
                let own = taken.taken_back_from(*last_term);
                *waits_until = taken.wait_until(*last_term, *waits_until, now);
                *term = Some(taken.term);
                *last_term = Some(taken.term);
                *lock_at = *waits_until;
                if own {
                    tracing::info!(
                        term = taken.term.get(),
                        "took the outbox back after losing the session (no other leader since)"
                    );
                }
            }
            self.set_leader(true, taken.previous_term);
            return Ok(true);
        }
        crate::metrics::gauge!(m::LEADER).set(0.0);
        let Ownership::Single { standby_logged, lock_at, watch, .. } = self else { return Ok(false) };
        if !*standby_logged {
            *standby_logged = true;
            tracing::info!(
                signal = "standby",
                role = "standby",
                "standby: another consumer holds the outbox lock; waiting to take over"
            );
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
    /// The scope of partition `p`'s term: `partition:P/N`, or
    /// `subscription:NAME:partition:P/N` for a named subscription.
    fn scope(&self, p: i32) -> String {
        format!("{}{p}/{}", self.scope_prefix, self.partitions)
    }

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
        let busy: BTreeSet<i32> = self.part_of.values().map(|(part, _)| *part).collect();
        let free: Vec<i32> = self.releasing.iter().copied().filter(|p| !busy.contains(p)).collect();
        for p in free {
            // Nothing of it is in flight: the next holder need not wait.
            if let Some(term) = self.terms.remove(&p)
                && self.waits.get(&p).is_none_or(|t| *t <= Instant::now())
            {
                cx.work.release_term(&self.scope(p), term, cx.stop()).await?;
            }
            cx.work.unlock_partition(p, cx.stop()).await?;
            self.releasing.remove(&p);
        }
        if self.owned.len() == before {
            return Ok(false);
        }
        tracing::info!(signal = "partitions", role = "partitioned", owned = ?self.owned, members, "partitions rebalanced");
        crate::metrics::gauge!(m::PARTITIONS_OWNED).set(self.owned.len() as f64);
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
                let scope = self.scope(p);
                let taken = cx.work.take_term(&scope, cx.stop()).await?;
                let taken = above_seen(cx, &scope, taken, self.last_terms.values().max().copied()).await?;
                let now = Instant::now();
                let last = self.last_terms.get(&p).copied();
                match taken.wait_until(last, self.waits.get(&p).copied(), now) {
                    Some(until) => {
                        tracing::info!(partition = p, term = taken.term.get(),
                            ended_term = taken.previous_term.map(Term::get),
                            wait = ?until.saturating_duration_since(now),
                            "took a partition whose previous holder did not release it (it crashed, froze or lost \
                             its connection): its delivery starts once that holder's hand-out lease has run out");
                        self.waits.insert(p, until);
                    }
                    None => {
                        self.waits.remove(&p);
                    }
                }
                self.terms.insert(p, taken.term);
                self.last_terms.insert(p, taken.term);
                self.owned.insert(p);
            }
        }
        Ok(())
    }

    /// The partitions owned and not waiting out a takeover.
    fn fetchable(&self) -> impl Iterator<Item = i32> + '_ {
        let now = Instant::now();
        self.owned.iter().copied().filter(move |part| self.waits.get(part).is_none_or(|t| *t <= now))
    }
}

/// What the terms a fetch or a confirmation read say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TermCheck {
    /// No term is held: nothing is fenced.
    Unfenced,
    /// Nothing was read to confirm the terms with (a fetch of no rows).
    Unconfirmed,
    /// Every term held is current.
    Confirmed,
    /// A term held (`term`) is no longer current (`current`, `None` when
    /// it could not be read).
    Superseded { term: Option<Term>, current: Option<Term> },
}

/// A term just taken of `scope` that is not above `seen`, the highest this
/// consumer took before, means the database's terms went back (an
/// asynchronous failover lost the last bumps, or a restore): the term is
/// raised above `seen`, so it never repeats one a destination may have
/// seen, and the takeover wait is never skipped (another relay may have
/// led on what was lost).
async fn above_seen(
    cx: Cx<'_>,
    scope: &str,
    mut taken: TermTaken,
    seen: Option<Term>,
) -> Result<TermTaken, StatementError> {
    let Some(seen) = seen.filter(|s| taken.term <= *s) else { return Ok(taken) };
    let raised = cx.work.raise_term(scope, seen, cx.stop()).await?;
    tracing::warn!(
        signal = "term_raised",
        scope,
        database_term = taken.term.get(),
        seen = seen.get(),
        term = raised.get(),
        "the database's leadership term ({}) is not above one this relay already took ({}): an asynchronous \
         failover or a restore lost the last terms; taking {} instead, and waiting out any lease of a leader \
         that led on what was lost",
        taken.term,
        seen,
        raised
    );
    taken.term = raised;
    taken.previous_released = false;
    taken.previous_term = None;
    Ok(taken)
}

impl TermTaken {
    /// This term was taken back from this consumer itself (its last term,
    /// `last`, was the previous one: no other holder since).
    fn taken_back_from(&self, last: Option<Term>) -> bool {
        self.previous_term.is_some() && self.previous_term == last
    }

    /// When the holder that just took this term may fetch: after
    /// [`TAKEOVER_WAIT`] when the previous holder did not release its term
    /// (unless the previous holder was this consumer, `last`: its own
    /// buffer went with its session), and never before a wait it had not
    /// finished when it lost its session (`pending`). `None`: at once.
    fn wait_until(&self, last: Option<Term>, pending: Option<Instant>, now: Instant) -> Option<Instant> {
        let inherited = pending.filter(|t| *t > now);
        if self.previous_released || self.taken_back_from(last) { inherited } else { Some(now + TAKEOVER_WAIT) }
    }
}
