//! The Redis Streams sink's own tests: broker replies read, fields named.

use super::*;

#[test]
fn only_policies_that_evict_keys_without_an_expiry_break_exactly_once() {
    let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:allkeys-lru\r\n";
    let why = info_field(info, "maxmemory_policy").and_then(eviction_breaks).unwrap_or_default();
    assert!(why.contains("allkeys-lru") && why.contains("noeviction"), "{why}");
    for keeps in ["noeviction", "volatile-lru", "volatile-ttl"] {
        assert_eq!(eviction_breaks(keeps), None, "{keeps}");
    }
    assert_eq!(info_field("maxmemory_policy:noeviction", "maxmemory"), None, "whole field names only");
}

#[test]
fn entry_ids_compare_as_pairs_and_xinfo_fields_are_read_by_name() {
    assert!(entry_id("9-0") < entry_id("10-0"), "numeric, not textual");
    assert_eq!(entry_id("12-3"), Some((12, 3)));
    assert_eq!(entry_id("x"), None);
    let reply = redis::Value::Array(vec![
        redis::Value::BulkString(b"length".to_vec()),
        redis::Value::Int(2),
        redis::Value::BulkString(b"max-deleted-entry-id".to_vec()),
        redis::Value::BulkString(b"0-0".to_vec()),
        redis::Value::BulkString(b"first-entry".to_vec()),
        redis::Value::Array(vec![]),
    ]);
    let f = xinfo_fields(&reply);
    assert_eq!(f.get("length").map(String::as_str), Some("2"));
    assert_eq!(f.get("max-deleted-entry-id").map(String::as_str), Some("0-0"));
    assert!(!f.contains_key("first-entry"), "entries are not fields");
}

#[test]
fn the_version_comes_from_info_server() {
    assert_eq!(redis_version("# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n"), Some((7, 0)));
    assert_eq!(redis_version("redis_version:4.0.9"), Some((4, 0)));
    assert_eq!(redis_version("# Server\r\n"), None);
}

#[test]
fn fields_follow_the_documented_names() {
    let msg = Message {
        id: "9".into(),
        key: "a".into(),
        body: b"{\"x\":1}".to_vec(),
        content_type: "application/json",
        headers: vec![
            (header::ID, "9".into()),
            (header::EVENT_TYPE, "Shipped".into()),
            (header::AGGREGATE_TYPE, "order".into()),
            (header::AGGREGATE_ID, "a".into()),
            (header::OCCURRED_AT, "2026-01-01T00:00:00Z".into()),
            (header::CONTENT_TYPE, "application/json".into()),
            (header::TRACEPARENT, "00-x-y-01".into()),
        ],
    };
    let f: Vec<(&str, &str)> =
        fields(&msg).into_iter().map(|(k, v)| (k, std::str::from_utf8(v).expect("utf-8"))).collect();
    assert_eq!(
        f,
        [
            ("id", "9"),
            ("type", "Shipped"),
            ("aggregate_type", "order"),
            ("aggregate", "a"),
            ("occurred_at", "2026-01-01T00:00:00Z"),
            ("payload", "{\"x\":1}"),
            ("content_type", "application/json"),
            ("traceparent", "00-x-y-01"),
        ]
    );
}
