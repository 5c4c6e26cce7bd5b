//! The WAL floor: the publications and a bare logical-replication reader
//! ([`BareStream`]), to tell the WAL source's own cost from what reading
//! the WAL costs whoever does it.

use super::*;

/// The publication the WAL source reads, as `pg-outbox migrate --source
/// wal` creates it on PostgreSQL 15 and later (inserts only, the id column
/// alone), for the bare reader on databases set up for the listen source.
pub(super) const OUTBOX_PUBLICATION: &str = "DO $$ BEGIN \
       IF current_setting('server_version_num')::int >= 150000 THEN \
         EXECUTE 'CREATE PUBLICATION pg_outbox FOR TABLE events.outbox (id) WITH (publish = ''insert'')'; \
       ELSE \
         CREATE PUBLICATION pg_outbox FOR TABLE events.outbox WITH (publish = 'insert'); \
       END IF; END $$";
/// The latency floor's publication: inserts into the floor's plain table,
/// payload included (the bare reader takes the send time from it).
pub(super) const FLOOR_PUBLICATION: &str =
    "CREATE PUBLICATION pgo_bench_floor FOR TABLE pgo_bench_floor WITH (publish = 'insert')";

/// A bare logical-replication reader, the floor of any WAL source: a
/// replication connection (pgwire-replication, as the WAL source's) with a
/// temporary `pgoutput` slot, streaming `publication`, confirming each
/// commit's end and each keepalive's WAL end, and doing nothing else; with
/// a probe, it records each insert's send time (the `payload` column's
/// `data.t`, see [`insert_sent_us`]) when the insert arrives. Its
/// application name is not `pg-outbox...`, so a relay's CPU reading never
/// counts it.
pub(super) struct BareStream {
    pub(super) stop: oneshot::Sender<()>,
    /// Inserts read so far.
    pub(super) read: Arc<AtomicU64>,
    /// Inserts read, or why the stream failed.
    pub(super) task: JoinHandle<BenchResult<u64>>,
}

/// The send time (µs on the probe's clock) in the JSON of the second column
/// (`payload`) of a pgoutput Insert message ('I', relation id, 'N', column
/// count, then each column: 't' and a 4-byte length and its text, or 'n'
/// for NULL, 'u' for an unchanged TOAST value); `None` for anything else.
pub(super) fn insert_sent_us(data: &[u8]) -> Option<u64> {
    let (&kind, rest) = data.split_first()?;
    if kind != b'I' || rest.get(4) != Some(&b'N') {
        return None;
    }
    let columns = u16::from_be_bytes([*rest.get(5)?, *rest.get(6)?]);
    let mut at = 7;
    let mut text = None;
    for _ in 0..columns {
        match *rest.get(at)? {
            b't' | b'b' => {
                let len = u32::from_be_bytes(rest.get(at + 1..at + 5)?.try_into().ok()?) as usize;
                text = Some(rest.get(at + 5..at + 5 + len)?);
                at += 5 + len;
            }
            _ => {
                text = None;
                at += 1;
            }
        }
    }
    let payload: serde_json::Value = serde_json::from_slice(text?).ok()?;
    payload["data"]["t"].as_u64()
}

impl BareStream {
    /// Open the replication connection for `cfg`'s database, create the
    /// slot, start streaming `publication`.
    pub(super) async fn start(cfg: &Config, publication: &str, probe: Option<Arc<Probe>>) -> BenchResult<BareStream> {
        let user = cfg.get_user().ok_or("the bare reader needs a user name")?;
        let db = cfg.get_dbname().unwrap_or(user);
        let password = cfg.get_password().map(|p| String::from_utf8_lossy(p).into_owned()).unwrap_or_default();
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let nanos = std::time::SystemTime::now().duration_since(std::time::SystemTime::UNIX_EPOCH)?.as_nanos();
        let slot = format!("pgo_bench_{:x}", nanos & 0xffff_ffff_ffff);
        let rc = match cfg.get_hosts().first().ok_or("the bare reader needs a host")? {
            Host::Unix(dir) => {
                ReplicationConfig::unix(dir.display().to_string(), port, user, password, db, &slot, publication)
            }
            Host::Tcp(host) => ReplicationConfig::new(host.clone(), user, password, db, &slot, publication)
                .with_port(port)
                .with_tls(TlsConfig::disabled()),
        }
        .with_start_lsn(Lsn::ZERO)
        .with_status_interval(Duration::from_secs(1))
        .with_application_name("pgo-bench bare reader");
        let mut client = ReplicationClient::connect_gated(rc).await?;
        client
            .simple_query(&format!("CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT"))
            .await?;
        client.start().await?;
        client.wait_started().await?;
        let (stop, mut stopped) = oneshot::channel::<()>();
        let read = Arc::new(AtomicU64::new(0));
        let counter = read.clone();
        let task = tokio::spawn(async move {
            let ended = loop {
                let event = tokio::select! {
                    _ = &mut stopped => break None,
                    e = client.recv() => e,
                };
                match event {
                    Ok(Some(ReplicationEvent::XLogData { data, .. })) => {
                        if data.first() == Some(&b'I') {
                            counter.fetch_add(1, Ordering::Relaxed);
                            if let Some(probe) = &probe
                                && let Some(t) = insert_sent_us(&data)
                            {
                                probe.record(t);
                            }
                        }
                    }
                    Ok(Some(ReplicationEvent::Commit { end_lsn, .. })) => client.update_applied_lsn(end_lsn),
                    Ok(Some(ReplicationEvent::KeepAlive { wal_end, .. })) => client.update_applied_lsn(wal_end),
                    Ok(Some(ReplicationEvent::StoppedAt { .. })) | Ok(None) => {
                        break Some(format!("the server ended the bare reader's stream (slot {slot})"));
                    }
                    Ok(Some(_)) => {}
                    Err(e) => break Some(format!("the bare reader's stream (slot {slot}): {e}")),
                }
            };
            client.stop();
            let _ = tokio::time::timeout(Duration::from_secs(2), client.shutdown()).await;
            client.abort();
            match ended {
                None => Ok(counter.load(Ordering::Relaxed)),
                Some(why) => Err(why.into()),
            }
        });
        Ok(BareStream { stop, read, task })
    }

    /// Wait (at most [`CATCH_UP`]) until the reader has read `n` inserts;
    /// an error naming how many it read when it has not.
    pub(super) async fn caught_up(&self, n: u64) -> BenchResult<()> {
        let deadline = Instant::now() + CATCH_UP;
        while self.read.load(Ordering::Relaxed) < n {
            if self.task.is_finished() || Instant::now() >= deadline {
                return Err(format!(
                    "the bare reader read {} of {n} inserts within {} s",
                    self.read.load(Ordering::Relaxed),
                    CATCH_UP.as_secs()
                )
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Stop reading; the inserts read, or why the stream failed before.
    pub(super) async fn stop(self) -> BenchResult<u64> {
        let _ = self.stop.send(());
        self.task.await?
    }
}
