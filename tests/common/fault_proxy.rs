//! A loopback HTTP/1.1 proxy in front of an S3 server that can be switched, at run time, to
//! answer every request itself with an S3 error (500 InternalError, 503 SlowDown, 403
//! AccessDenied, each with S3's XML body), or to take requests and never answer them; it
//! counts the requests it saw in each mode.
//!
//! Each request is read whole (its body framed by Content-Length or chunked, as HTTP
//! clients send them) before it is answered, so a client is never cut off mid-upload. A
//! forwarded request goes to the server on a connection of its own with `Connection:
//! close`, and its answer is relayed as the server sent it; the proxy's own answers carry
//! `Connection: close` too. At most `MAX_CONNECTIONS` connections are served at once (a
//! thread each); more wait in the listener's backlog.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections served at once.
const MAX_CONNECTIONS: usize = 64;
/// How often a waiting thread looks at the mode and whether the proxy is stopping.
const POLL: Duration = Duration::from_millis(20);
/// A client that sends nothing, or a server that answers nothing, for this long: the
/// connection is closed.
const IDLE: Duration = Duration::from_secs(60);

/// How the proxy answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Requests go to the server; its answers come back.
    Forward = 0,
    /// 500 InternalError.
    InternalError = 1,
    /// 503 SlowDown, S3's throttling answer.
    SlowDown = 2,
    /// 403 AccessDenied: the credentials or the bucket's policy refuse the request.
    AccessDenied = 3,
    /// Requests are read and never answered: a server that takes connections and stalls.
    /// A stalled connection is closed once the mode changes.
    Stall = 4,
}

const MODES: [Mode; 5] = [Mode::Forward, Mode::InternalError, Mode::SlowDown, Mode::AccessDenied, Mode::Stall];

impl Mode {
    /// The answer's status line, S3 error code and message.
    fn error(self) -> Option<(&'static str, &'static str, &'static str)> {
        match self {
            Mode::InternalError => {
                Some(("500 Internal Server Error", "InternalError", "We encountered an internal error. Please try again."))
            }
            Mode::SlowDown => Some(("503 Slow Down", "SlowDown", "Please reduce your request rate.")),
            Mode::AccessDenied => Some(("403 Forbidden", "AccessDenied", "Access Denied")),
            Mode::Forward | Mode::Stall => None,
        }
    }
}

struct State {
    upstream: SocketAddr,
    mode: AtomicU8,
    seen: [AtomicU64; MODES.len()],
    live: AtomicUsize,
    stop: AtomicBool,
}

impl State {
    fn mode(&self) -> Mode {
        MODES[self.mode.load(Ordering::SeqCst) as usize]
    }
}

pub struct FaultProxy {
    state: Arc<State>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy on a free loopback port in front of the server at `upstream`, forwarding.
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the proxy's port");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            upstream,
            mode: AtomicU8::new(Mode::Forward as u8),
            seen: Default::default(),
            live: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let s = state.clone();
        let acceptor = std::thread::Builder::new().name("fault-proxy".into()).spawn(move || accept(listener, s)).unwrap();
        FaultProxy { state, addr, acceptor: Some(acceptor) }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How requests are answered from now on.
    pub fn set(&self, mode: Mode) {
        self.state.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Requests read whole while the proxy was in `mode`.
    pub fn seen(&self, mode: Mode) -> u64 {
        self.state.seen[mode as usize].load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    /// Stops taking connections; those waiting on their client end within `POLL`, those
    /// waiting on the server within `IDLE`.
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

fn accept(listener: TcpListener, state: Arc<State>) {
    for conn in listener.incoming() {
        if state.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        while state.live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            std::thread::sleep(POLL);
        }
        state.live.fetch_add(1, Ordering::SeqCst);
        let s = state.clone();
        std::thread::spawn(move || {
            let _ = serve(conn, &s);
            s.live.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// One client connection's bytes, read as they come.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    /// Reads more bytes into `buf`: false once the client has closed, an error once the
    /// proxy stops or the client sent nothing for `IDLE`.
    fn fill(&mut self, state: &State) -> std::io::Result<bool> {
        let t0 = Instant::now();
        let mut chunk = [0u8; 64 << 10];
        loop {
            if state.stop.load(Ordering::SeqCst) || t0.elapsed() > IDLE {
                return Err(ErrorKind::TimedOut.into());
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The next `\r\n`-ended line, with its `\r\n`.
    fn line(&mut self, state: &State) -> std::io::Result<Vec<u8>> {
        loop {
            if let Some(at) = self.buf.windows(2).position(|w| w == b"\r\n") {
                return Ok(self.buf.drain(..at + 2).collect());
            }
            if !self.fill(state)? {
                return Err(ErrorKind::UnexpectedEof.into());
            }
        }
    }

    /// The next `n` bytes.
    fn take(&mut self, n: usize, state: &State) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill(state)? {
                return Err(ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.drain(..n).collect())
    }
}

/// One request, read whole.
struct Request {
    method: String,
    /// The request line and the headers, each with its `\r\n`, but `Connection`.
    head: Vec<u8>,
    /// The body as sent (chunked or not).
    body: Vec<u8>,
}

/// The next request on `c`; `None` when the client closed the connection between requests.
fn read_request(c: &mut Conn, state: &State) -> std::io::Result<Option<Request>> {
    while c.buf.is_empty() {
        if !c.fill(state)? {
            return Ok(None);
        }
    }
    let first = c.line(state)?;
    let method = String::from_utf8_lossy(&first).split_whitespace().next().unwrap_or_default().to_string();
    let mut head = first;
    let (mut length, mut chunked) = (0usize, false);
    loop {
        let line = c.line(state)?;
        if line == b"\r\n" {
            break;
        }
        let text = String::from_utf8_lossy(&line).to_ascii_lowercase();
        let (name, value) = text.split_once(':').unwrap_or((&text, ""));
        match name.trim() {
            "content-length" => length = value.trim().parse().map_err(|_| ErrorKind::InvalidData)?,
            "transfer-encoding" => chunked = value.contains("chunked"),
            "connection" | "keep-alive" => continue,
            _ => {}
        }
        head.extend_from_slice(&line);
    }
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let size_line = c.line(state)?;
            let size = String::from_utf8_lossy(&size_line);
            let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).map_err(|_| ErrorKind::InvalidData)?;
            body.extend_from_slice(&size_line);
            if size == 0 {
                // Trailers, then the empty line that ends the body.
                loop {
                    let t = c.line(state)?;
                    body.extend_from_slice(&t);
                    if t == b"\r\n" {
                        break;
                    }
                }
                break;
            }
            body.extend_from_slice(&c.take(size + 2, state)?);
        }
        body
    } else {
        c.take(length, state)?
    };
    Ok(Some(Request { method, head, body }))
}

fn serve(stream: TcpStream, state: &State) -> std::io::Result<()> {
    stream.set_read_timeout(Some(POLL))?;
    let mut c = Conn { stream, buf: Vec::new() };
    while let Some(req) = read_request(&mut c, state)? {
        let mode = state.mode();
        state.seen[mode as usize].fetch_add(1, Ordering::SeqCst);
        if let Some((status, code, message)) = mode.error() {
            let xml = format!(
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message>\
                 <RequestId>kvx-fault-proxy</RequestId></Error>"
            );
            // A HEAD's answer has no body.
            let body = if req.method == "HEAD" { "" } else { xml.as_str() };
            write!(
                c.stream,
                "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )?;
            break;
        }
        if mode == Mode::Stall {
            // Until the mode changes, the proxy stops or the client gives up (closes).
            while state.mode() == Mode::Stall && !state.stop.load(Ordering::SeqCst) {
                match c.stream.peek(&mut [0u8]) {
                    Ok(0) => break,
                    Err(e) if !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => break,
                    _ => std::thread::sleep(POLL),
                }
            }
            break;
        }
        if !forward(&req, &mut c.stream, state)? {
            break;
        }
    }
    let _ = c.stream.shutdown(Shutdown::Both);
    Ok(())
}

/// Sends `req` to the server on a connection of its own and relays its whole answer:
/// whether the client's connection may carry another request.
fn forward(req: &Request, client: &mut TcpStream, state: &State) -> std::io::Result<bool> {
    let mut up = TcpStream::connect_timeout(&state.upstream, IDLE)?;
    up.set_read_timeout(Some(IDLE))?;
    up.write_all(&req.head)?;
    up.write_all(b"Connection: close\r\n\r\n")?;
    up.write_all(&req.body)?;
    // The server closes the connection after its answer, as asked.
    let mut answer = Vec::new();
    up.read_to_end(&mut answer)?;
    client.write_all(&answer)?;
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(answer.len());
    let head = String::from_utf8_lossy(&answer[..end]).to_ascii_lowercase();
    let close = head.starts_with("http/1.0") || head.lines().any(|l| l.starts_with("connection:") && l.contains("close"));
    Ok(!close)
}
