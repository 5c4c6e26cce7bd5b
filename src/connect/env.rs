//! What a connection string leaves unset, filled as libpq fills it: from
//! the `PG*` environment variables, then libpq's defaults (see `libpq`).

use std::time::Duration;

use tokio_postgres::Config;

use super::libpq;
use crate::error::{Error, Result};

/// PostgreSQL's default port.
pub(super) const DEFAULT_PORT: u16 = 5432;

/// Fill what the string left unset from the `PG*` variables of `env`, then
/// libpq's defaults (PostgreSQL docs, libpq "Environment Variables" and
/// "Parameter Key Words"). TLS settings and the password file are the
/// caller's.
pub(super) fn fill_from_env(pg: &mut Config, env: libpq::Lookup<'_>) -> Result<()> {
    if pg.get_hosts().is_empty() && pg.get_hostaddrs().is_empty() {
        match env("PGHOST") {
            Some(hosts) => {
                for h in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
                    // A value starting with `/` is a socket directory.
                    pg.host(h);
                }
            }
            None => default_hosts(pg),
        }
        if pg.get_hosts().is_empty() {
            default_hosts(pg);
        }
    }
    if pg.get_ports().is_empty()
        && let Some(ports) = env("PGPORT")
    {
        for p in ports.split(',').map(str::trim) {
            let port = p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
                Error::Config(format!(
                    "invalid PGPORT `{ports}`: expected a port number (1-65535), or several, comma separated"
                ))
            })?;
            pg.port(port);
        }
    }
    if pg.get_user().is_none() {
        match env("PGUSER").or_else(libpq::os_user) {
            Some(u) => {
                pg.user(u);
            }
            None => {
                return Err(Error::Config(
                    "no user name given and the operating system user's name cannot be read: \
                     set user= in the connection string, or PGUSER"
                        .into(),
                ));
            }
        }
    }
    if pg.get_password().is_none()
        && let Some(pw) = env("PGPASSWORD")
    {
        pg.password(pw);
    }
    if pg.get_dbname().is_none() {
        let db = env("PGDATABASE").or_else(|| pg.get_user().map(str::to_owned));
        if let Some(db) = db {
            pg.dbname(db);
        }
    }
    if pg.get_application_name().is_none()
        && let Some(name) = env("PGAPPNAME")
    {
        pg.application_name(name);
    }
    if pg.get_connect_timeout().is_none()
        && let Some(t) = env("PGCONNECT_TIMEOUT")
    {
        let secs = t.trim().parse::<i64>().map_err(|_| {
            Error::Config(format!("invalid PGCONNECT_TIMEOUT `{t}`: expected whole seconds (0 or less: no limit)"))
        })?;
        // As tokio-postgres's `connect_timeout`: 0 or less sets none.
        if let Ok(secs @ 1..) = u64::try_from(secs) {
            pg.connect_timeout(Duration::from_secs(secs));
        }
    }
    Ok(())
}

/// libpq's default host: the Unix socket directories (see
/// [`libpq::default_socket_dirs`]), or `localhost` where there are no Unix
/// sockets.
fn default_hosts(pg: &mut Config) {
    #[cfg(unix)]
    for dir in libpq::default_socket_dirs() {
        pg.host_path(dir);
    }
    #[cfg(not(unix))]
    pg.host("localhost");
}

#[cfg(test)]
mod tests {
    //! libpq's variables, defaults and password file, with the variables
    //! from a map (the process environment is neither read nor changed).

    use tokio_postgres::config::Host;

    use super::*;
    use crate::connect::testing::parse_in;
    use crate::connect::{ConnectOptions, RootCert, SslMode};

    fn password(o: &ConnectOptions) -> Option<String> {
        o.tokio_postgres_config().get_password().map(|p| String::from_utf8_lossy(p).into_owned())
    }

    fn tcp(h: &str) -> Host {
        Host::Tcp(h.to_string())
    }

    fn default_sockets() -> Vec<Host> {
        libpq::default_socket_dirs().into_iter().map(Host::Unix).collect()
    }

    const ALL: [(&str, &str); 9] = [
        ("PGHOST", "db.example.com"),
        ("PGPORT", "6543"),
        ("PGUSER", "envuser"),
        ("PGPASSWORD", "envpw"),
        ("PGDATABASE", "envdb"),
        ("PGSSLMODE", "verify-ca"),
        ("PGSSLROOTCERT", "/env/ca.pem"),
        ("PGAPPNAME", "envapp"),
        ("PGCONNECT_TIMEOUT", "7"),
    ];

    #[test]
    fn each_variable_fills_its_setting() {
        let o = parse_in("", &ALL).expect("variables alone");
        assert_eq!(o.hosts(), &[tcp("db.example.com")]);
        assert_eq!(o.ports(), &[6543]);
        assert_eq!(o.user(), Some("envuser"));
        assert_eq!(password(&o).as_deref(), Some("envpw"));
        assert_eq!(o.dbname(), Some("envdb"));
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
        assert_eq!(o.root_cert(), Some(&RootCert::File("/env/ca.pem".into())));
        assert_eq!(o.application_name(), Some("envapp"));
        assert_eq!(o.connect_timeout(), Some(Duration::from_secs(7)));
    }

    #[test]
    fn the_strings_fields_win_over_the_variables() {
        for s in [
            "postgres://u:p@h:1/d?sslmode=disable&sslrootcert=/s/ca.pem&application_name=a&connect_timeout=3",
            "host=h port=1 user=u password=p dbname=d sslmode=disable sslrootcert=/s/ca.pem application_name=a \
             connect_timeout=3",
        ] {
            let o = parse_in(s, &ALL).expect("string");
            assert_eq!(o.hosts(), &[tcp("h")], "{s}");
            assert_eq!(o.ports(), &[1], "{s}");
            assert_eq!(o.user(), Some("u"), "{s}");
            assert_eq!(password(&o).as_deref(), Some("p"), "{s}");
            assert_eq!(o.dbname(), Some("d"), "{s}");
            assert_eq!(o.ssl_mode(), SslMode::Disable, "{s}");
            assert_eq!(o.root_cert(), Some(&RootCert::File("/s/ca.pem".into())), "{s}");
            assert_eq!(o.application_name(), Some("a"), "{s}");
            assert_eq!(o.connect_timeout(), Some(Duration::from_secs(3)), "{s}");
        }
        // Field by field: what the string leaves out comes from the variables.
        let o = parse_in("postgres://u@/d", &ALL).expect("hostless");
        assert_eq!((o.hosts(), o.ports()), (&[tcp("db.example.com")][..], &[6543][..]));
        assert_eq!((o.user(), o.dbname()), (Some("u"), Some("d")));
        assert_eq!(password(&o).as_deref(), Some("envpw"));
        assert_eq!(o.ssl_mode(), SslMode::VerifyCa);
    }

    #[test]
    fn hostless_strings_use_pghost_else_the_unix_socket() {
        let os_user = libpq::os_user().expect("the OS user's name");
        for s in ["postgres://postgres@/app", "dbname=app user=postgres", "postgresql://postgres@/app"] {
            let o = parse_in(s, &[]).expect(s);
            assert_eq!(o.hosts(), &default_sockets()[..], "{s}");
            assert!(o.ports().is_empty(), "{s}: 5432");
            assert_eq!((o.user(), o.dbname()), (Some("postgres"), Some("app")), "{s}");
            let o = parse_in(s, &[("PGHOST", "127.0.0.1")]).expect(s);
            assert_eq!(o.hosts(), &[tcp("127.0.0.1")], "{s}");
            let o = parse_in(s, &[("PGHOST", "/run/pg")]).expect(s);
            assert_eq!(o.hosts(), &[Host::Unix("/run/pg".into())], "{s}: a directory is a socket");
        }
        // No user given: PGUSER, else the OS user; no database: PGDATABASE, else the user.
        let o = parse_in("postgres:///app", &[]).expect("no user");
        assert_eq!((o.user(), o.dbname()), (Some(os_user.as_str()), Some("app")));
        let o = parse_in("", &[]).expect("nothing at all");
        assert_eq!(o.hosts(), &default_sockets()[..]);
        assert_eq!((o.user(), o.dbname()), (Some(os_user.as_str()), Some(os_user.as_str())));
        assert_eq!(o.ssl_mode(), SslMode::Prefer);
        let o = parse_in("host=h", &[("PGUSER", "alice")]).expect("PGUSER");
        assert_eq!((o.user(), o.dbname()), (Some("alice"), Some("alice")));
        let o = parse_in("user=bob host=h", &[("PGUSER", "alice")]).expect("user wins");
        assert_eq!((o.user(), o.dbname()), (Some("bob"), Some("bob")));
        // hostaddr alone is a host, as in libpq.
        let o = parse_in("hostaddr=127.0.0.1 user=u", &[("PGHOST", "elsewhere")]).expect("hostaddr");
        assert!(o.hosts().is_empty());
        // Several hosts and ports.
        let o = parse_in("user=u", &[("PGHOST", "/sock, h2"), ("PGPORT", "5433,5434")]).expect("lists");
        assert_eq!(o.hosts(), &[Host::Unix("/sock".into()), tcp("h2")]);
        assert_eq!(o.ports(), &[5433, 5434]);
    }

    #[test]
    fn bad_variables_are_named() {
        for (var, value, needle) in [
            ("PGPORT", "abc", "invalid PGPORT `abc`"),
            ("PGPORT", "0", "invalid PGPORT `0`"),
            ("PGPORT", "5432,x", "invalid PGPORT `5432,x`"),
            ("PGSSLMODE", "bogus", "invalid sslmode `bogus`"),
            ("PGCONNECT_TIMEOUT", "soon", "invalid PGCONNECT_TIMEOUT `soon`"),
        ] {
            let e = parse_in("host=h user=u", &[(var, value)]).expect_err(var);
            assert!(e.to_string().contains(needle), "{var}={value}: {e}");
        }
        let o = parse_in("host=h user=u", &[("PGCONNECT_TIMEOUT", "0")]).expect("0 sets none");
        assert_eq!(o.connect_timeout(), None);
        let o = parse_in("host=h user=u", &[("PGSSLROOTCERT", "system")]).expect("system roots");
        assert_eq!(o.ssl_mode(), SslMode::VerifyFull, "sslrootcert=system makes verify-full the default");
        let e = parse_in("host=h user=u", &[("PGSSLROOTCERT", "system"), ("PGSSLMODE", "require")]).expect_err("weak");
        assert!(e.to_string().contains("sslrootcert=system requires sslmode=verify-full"), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn the_password_file_supplies_a_missing_password() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("pgpass");
        std::fs::write(
            &file,
            "localhost:5432:app:postgres:sockpw\ndb.example.com:6543:*:app:tcppw\n/run/pg:*:*:*:dirpw\n",
        )
        .expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let path = file.display().to_string();
        let env = [("PGPASSFILE", path.as_str())];
        // A socket in a default directory matches `localhost`.
        assert_eq!(password(&parse_in("postgres://postgres@/app", &env).expect("url")).as_deref(), Some("sockpw"));
        assert_eq!(
            password(&parse_in("postgres://app@db.example.com:6543/x", &env).expect("url")).as_deref(),
            Some("tcppw")
        );
        // Another socket directory matches as its path.
        assert_eq!(password(&parse_in("host=/run/pg user=u", &env).expect("kv")).as_deref(), Some("dirpw"));
        // A password given, in the string or PGPASSWORD, wins over the file.
        let given = parse_in("postgres://app:given@db.example.com:6543/x", &env).expect("url");
        assert_eq!(password(&given).as_deref(), Some("given"));
        let from_var =
            parse_in("postgres://app@db.example.com:6543/x", &[env[0], ("PGPASSWORD", "envpw")]).expect("url");
        assert_eq!(password(&from_var).as_deref(), Some("envpw"));
        // No matching line; and the database changed after parsing is the one matched.
        let o = parse_in("postgres://postgres@/other", &env).expect("url");
        assert_eq!(password(&o), None);
        assert_eq!(password(&o.with_dbname("app")).as_deref(), Some("sockpw"));
        // HOME/.pgpass is the default.
        std::fs::copy(&file, dir.path().join(".pgpass")).expect("copy");
        let home = dir.path().display().to_string();
        let o = parse_in("postgres://postgres@/app", &[("HOME", home.as_str())]).expect("url");
        assert_eq!(password(&o).as_deref(), Some("sockpw"));
    }
}
