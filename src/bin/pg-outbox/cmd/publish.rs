//! `pg-outbox publish`: insert one event and print its id.

use pg_outbox::{NewEvent, Publisher};

use crate::db::connect_primary;
use crate::error::Error;
use crate::parse::parse_uuid;

#[derive(clap::Args, Debug)]
pub(crate) struct PublishArgs {
    /// Kind of aggregate, e.g. subscription.
    #[arg(long)]
    aggregate_type: String,
    /// Aggregate id (a UUID).
    #[arg(long, value_parser = parse_uuid)]
    aggregate_id: uuid::Uuid,
    /// Event name, e.g. PaymentSucceeded.
    #[arg(long)]
    event_type: String,
    /// JSON payload, e.g. '{"version":1,"data":{"amount":990}}'; `-` reads
    /// it from standard input, `@FILE` from a file. At most 1 MiB (1048576
    /// bytes, the publisher's limit).
    #[arg(long)]
    payload: String,
}

pub(crate) async fn run(db: &pg_outbox::ConnectOptions, args: PublishArgs) -> Result<(), Error> {
    // Read at most one byte over the limit, so `@/dev/zero` or an endless
    // pipe is refused instead of filling memory.
    let limit = u64::try_from(pg_outbox::Publisher::DEFAULT_MAX_PAYLOAD_BYTES).unwrap_or(u64::MAX).saturating_add(1);
    let read_limited = |r: &mut dyn std::io::Read, what: &str| -> Result<String, Error> {
        let mut buf = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(r, limit), &mut buf)
            .map_err(|e| Error::InvalidEvent(format!("cannot read the payload from {what}: {e}")))?;
        if buf.len() as u64 >= limit {
            return Err(Error::InvalidEvent(format!(
                "the payload from {what} is over the limit of {} bytes",
                pg_outbox::Publisher::DEFAULT_MAX_PAYLOAD_BYTES
            )));
        }
        Ok(buf)
    };
    let text = if args.payload == "-" {
        read_limited(&mut std::io::stdin(), "standard input")?
    } else if let Some(path) = args.payload.strip_prefix('@') {
        let mut file = std::fs::File::open(path)
            .map_err(|e| Error::InvalidEvent(format!("cannot read the payload file {path}: {e}")))?;
        read_limited(&mut file, &format!("the file {path}"))?
    } else {
        args.payload.clone()
    };
    let payload: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::InvalidEvent(format!("--payload is not valid JSON: {e}")))?;
    let event = NewEvent::new(args.aggregate_type, args.aggregate_id, args.event_type, payload);
    let publisher = Publisher::new();
    event.validate(pg_outbox::Publisher::DEFAULT_MAX_PAYLOAD_BYTES)?;
    let client = connect_primary(db).await?;
    let id = publisher.publish(&client, &event).await?;
    println!("{id}");
    Ok(())
}
