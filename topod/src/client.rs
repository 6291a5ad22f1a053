//! A client of topod's socket, for `topoctl`, `topo-exec` and tests.

use crate::proto::{self, ErrorBody, Op, Request};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
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

/// One connection to topod: its local Unix socket, or its read-only TCP listener.
pub struct Client {
    reader: BufReader<Box<dyn Read + Send>>,
    writer: Box<dyn Write + Send>,
}

impl Client {
    /// Connects to the socket at `path`; a reply may take up to a minute (a release waits for
    /// the job's processes to die).
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        Self::connect_with_timeout(path, Duration::from_secs(60))
    }

    /// Connects to the socket at `path`; each read or write may take up to `timeout`.
    pub fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<Client, ClientError> {
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect { path: path.display().to_string(), source })?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let writer = stream.try_clone()?;
        Ok(Client { reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) })
    }

    /// Connects to topod's read-only TCP listener at `address` (`host:port`) and presents the
    /// shared `key`; connecting, and each read or write, may take up to `timeout`.
    pub fn connect_tcp(address: &str, key: &str, timeout: Duration) -> Result<Client, ClientError> {
        let connect_error = |source| ClientError::Connect { path: format!("tcp:{address}"), source };
        let addrs = address.to_socket_addrs().map_err(connect_error)?;
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(stream) => {
                    stream.set_read_timeout(Some(timeout))?;
                    stream.set_write_timeout(Some(timeout))?;
                    stream.set_nodelay(true)?;
                    let mut writer = stream.try_clone()?;
                    writer.write_all(format!("{key}\n").as_bytes())?;
                    return Ok(Client { reader: BufReader::new(Box::new(stream)), writer: Box::new(writer) });
                }
                Err(e) => last = e,
            }
        }
        Err(connect_error(last))
    }

    /// Sends one operation and returns the result.
    pub fn call(&mut self, op: Op) -> Result<serde_json::Value, ClientError> {
        self.writer.write_all(Request::new(op).to_line().as_bytes())?;
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if line.is_empty() {
            return Err(ClientError::Io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "topod closed the connection without a reply")));
        }
        let reply = proto::parse_reply(&line)?;
        match (reply.ok, reply.error) {
            (_, Some(e)) => Err(ClientError::Refused(e)),
            (Some(v), None) => Ok(v),
            (None, None) => Ok(serde_json::Value::Null),
        }
    }
}
