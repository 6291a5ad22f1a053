//! A client of topod's socket, for `topoctl`, `topo-exec` and tests.

use crate::proto::{self, ErrorBody, Op, Request};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon cannot be reached.
    #[error("cannot reach topod at {path}: {source} (is topod running? is the socket path right?)")]
    Connect {
        /// The socket.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection broke or timed out.
    #[error("talking to topod: {0}")]
    Io(#[from] std::io::Error),
    /// The reply is not a valid reply.
    #[error("topod sent an invalid reply: {0}")]
    Reply(#[from] proto::ProtoError),
    /// topod refused or failed.
    #[error("topod: {}", .0.message)]
    Refused(ErrorBody),
}

/// One connection to topod.
pub struct Client {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect { path: path.display().to_string(), source })?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let writer = stream.try_clone()?;
        Ok(Client { reader: BufReader::new(stream), writer })
    }

    /// Sends one operation and returns the result.
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        self.writer.write_all(Request::new(op).to_line().as_bytes())?;
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        let reply = proto::parse_reply(&line)?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(ClientError::Refused(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }
}
