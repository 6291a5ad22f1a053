//! One short conversation with the host's topod: blocking, with a deadline on every read and
//! write, no threads (the plug-in runs inside slurmstepd, which forks the tasks).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;
use topod::proto::{self, ErrorCode, Op, Request};

/// A failed call to topod.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The socket cannot be reached.
    #[error("cannot reach topod at {path}: {source} (is topod running? is socket= in plugstack.conf right?)")]
    Connect {
        /// The socket.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The conversation broke or timed out.
    #[error("talking to topod at {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// topod's answer is not a valid reply, or not the shape expected.
    #[error("topod at {path} sent an answer this plug-in does not understand: {what}")]
    Reply {
        /// The socket.
        path: String,
        /// What was wrong.
        what: String,
    },
    /// topod refused or failed.
    #[error("topod: {message}")]
    Refused {
        /// Its error code.
        code: ErrorCode,
        /// Its message.
        message: String,
    },
}

/// An open connection.
pub struct Topod {
    path: String,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Topod {
    /// Connects, with `timeout` on every later read and write.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Topod, LinkError> {
        let shown = path.display().to_string();
        // slurmstepd runs as root: the administrators' socket first, whatever users do on the
        // public one (an older topod has none).
        let admin = topod::proto::admin_socket_for(path);
        let stream = match UnixStream::connect(&admin) {
            Ok(s) => s,
            Err(_) => UnixStream::connect(path)
                .map_err(|source| LinkError::Connect { path: shown.clone(), source })?,
        };
        let io = |source| LinkError::Io { path: shown.clone(), source };
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
        let writer = stream.try_clone().map_err(io)?;
        Ok(Topod { path: shown, reader: BufReader::new(stream), writer })
    }

    /// Sends one operation and returns its result.
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, LinkError> {
        let io = |source| LinkError::Io { path: self.path.clone(), source };
        self.writer.write_all(Request::new(op).to_line().as_bytes()).map_err(io)?;
        let mut line = Vec::new();
        self.reader
            .read_until(b'\n', &mut line)
            .map_err(|source| LinkError::Io { path: self.path.clone(), source })?;
        let reply = proto::parse_reply(&line)
            .map_err(|e| LinkError::Reply { path: self.path.clone(), what: e.to_string() })?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(LinkError::Refused { code: e.code, message: e.message }),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }

    /// [`Topod::call`], decoding the result as `T`.
    pub fn call_as<T: serde::de::DeserializeOwned>(&mut self, op: Op) -> Result<T, LinkError> {
        let value = self.call(op)?;
        serde_json::from_value(value)
            .map_err(|e| LinkError::Reply { path: self.path.clone(), what: e.to_string() })
    }
}
