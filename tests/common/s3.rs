//! A real S3 server for the suites that need one: moto's (PyPI `moto[server]`), from the
//! venv `make s3-server-venv` makes, run as a child on loopback on a free port and killed
//! when dropped (or when this process dies).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn venv() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/s3-venv")
}

/// Why no S3 server can be started here, if none can.
pub fn why_no_server() -> Option<String> {
    (!venv().join("bin/moto_server").exists()).then(|| "no S3 test server (run make s3-server-venv)".to_string())
}

/// The longest a server takes to start (moto imports much; the machine may be busy).
const START: Duration = Duration::from_secs(120);

pub struct S3Server {
    child: Option<Child>,
    pub port: u16,
    check_credentials: bool,
}

impl S3Server {
    /// A server that takes any credentials.
    pub fn start() -> S3Server {
        S3Server::on(free_port(), false)
    }

    /// A server that refuses every access key (none is known to it): 403 to every request.
    pub fn start_checking_credentials() -> S3Server {
        S3Server::on(free_port(), true)
    }

    fn on(port: u16, check_credentials: bool) -> S3Server {
        let mut s = S3Server { child: None, port, check_credentials };
        s.restart();
        s
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again, empty, on the same port) and waits until it answers.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the S3 server is running");
        let log = crate::common::temp_path("moto.log");
        let mut cmd = Command::new(venv().join("bin/python"));
        cmd.args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &self.port.to_string()])
            .env("AWS_ACCESS_KEY_ID", "kvx-test")
            .env("AWS_SECRET_ACCESS_KEY", "kvx-test")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if self.check_credentials {
            // moto then checks every request's key against its IAM users, of which it has none.
            cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        // SAFETY: prctl is async-signal-safe; the server dies with the thread that started it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("starting moto's S3 server");
        let t0 = Instant::now();
        while self.request("GET", "/").is_err() {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("moto's S3 server exited ({status}); its log: {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(t0.elapsed() < START, "moto's S3 server did not answer within {START:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        self.child = Some(child);
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        let mut child = self.child.take().expect("the S3 server is running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a server that takes connections and never
    /// answers, as one stalled or overloaded.
    pub fn pause(&self, paused: bool) {
        let pid = self.child.as_ref().expect("the S3 server is running").id() as i32;
        // SAFETY: a signal to our own child.
        assert_eq!(unsafe { libc::kill(pid, if paused { libc::SIGSTOP } else { libc::SIGCONT }) }, 0);
    }

    /// Creates `bucket` (moto takes an unsigned CreateBucket).
    pub fn create_bucket(&self, bucket: &str) {
        let answer = self.request("PUT", &format!("/{bucket}")).expect("creating a bucket");
        assert_eq!(answer.split_whitespace().nth(1), Some("200"), "creating bucket {bucket}: {answer}");
    }

    /// One HTTP/1.0 request with an empty body: the answer, whole.
    fn request(&self, method: &str, path: &str) -> std::io::Result<String> {
        let mut c = TcpStream::connect(("127.0.0.1", self.port))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(c, "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\n\r\n", self.port)?;
        let mut answer = String::new();
        c.read_to_string(&mut answer)?;
        Ok(answer)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A loopback port nothing listens on (as the kernel hands them out, not reused soon).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
