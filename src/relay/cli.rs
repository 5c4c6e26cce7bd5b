//! The sink flags of the `pg-outbox` command line (`relay`, `replay`),
//! feature `cli`: [`SinkFlags`] holds one group per sink this build has,
//! made from the one list of sinks (`each_sink!`); each sink's module declares
//! its own group (`Flags`) and how it writes it into [`SinkSettings`].

use super::SinkSettings;
use super::sink_list::{dead_unless, each_sink};
use crate::error::Result;

/// [`SinkFlags`] from the entries of `each_sink!`.
macro_rules! sink_flags {
    ([] $($m:ident($k:ident, $e:ident, $feature:literal, $($rest:tt)*),)*) => {
        /// The flags of every sink this build has, one group per sink as
        /// the sink declares it, for `#[command(flatten)]` into a `clap`
        /// command (feature `cli`). The flags and their help are those of
        /// `pg-outbox relay --help`.
        #[derive(clap::Args, Debug)]
        #[group(skip)]
        pub struct SinkFlags {
            $(
                #[cfg(feature = $feature)]
                #[command(flatten)]
                $m: super::sinks::$m::Flags,
            )*
        }

        impl SinkFlags {
            /// Write each sink's flags into its options in `settings`,
            /// reading the secret files they name.
            ///
            /// # Errors
            /// [`Error::Config`](crate::Error::Config) naming the flag for
            /// an unreadable or empty secret file.
            pub fn apply(&self, settings: &mut SinkSettings) -> Result<()> {
                $(
                    #[cfg(feature = $feature)]
                    self.$m.apply(settings)?;
                )*
                Ok(())
            }
        }
    };
}

each_sink!(sink_flags);

dead_unless! {no_echo;
    /// A value parser for flags that may hold a secret (`KEY=VALUE`,
    /// `NAME: VALUE`): on a malformed value the error names the flag and the
    /// problem, never the value (clap's own errors quote it).
    #[derive(Clone)]
    pub(crate) struct NoEcho<T>(std::marker::PhantomData<T>);
}

dead_unless! {no_echo;
    impl<T> NoEcho<T> {
        /// The parser of values of type `T`.
        pub(crate) fn new() -> Self {
            NoEcho(std::marker::PhantomData)
        }
    }
}

impl<T> clap::builder::TypedValueParser for NoEcho<T>
where
    T: std::str::FromStr<Err = crate::Error> + Clone + Send + Sync + 'static,
{
    type Value = T;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> std::result::Result<T, clap::Error> {
        let flag = arg.and_then(clap::Arg::get_long).map_or_else(|| "a setting".to_string(), |l| format!("--{l}"));
        let refused = |why: String| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("{flag}: {why} (the value is not shown)\n"),
            )
        };
        let text = value.to_str().ok_or_else(|| refused("the value is not UTF-8".into()))?;
        text.parse().map_err(|e: crate::Error| refused(e.to_string()))
    }
}
