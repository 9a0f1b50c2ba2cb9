//! The one error type of the crate. Every failure carries a `Status` (the code a C
//! caller switches on) and a message that tells the caller what went wrong and what to do.

use std::fmt;

/// Outcome codes. The numbers are the C ABI's `KVX_*` values: explicit, never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    Pending = 1,
    InvalidArg = 2,
    OutOfRange = 3,
    Incompatible = 4,
    Unsupported = 5,
    NoDevice = 6,
    Cuda = 7,
    Io = 8,
    NoMemory = 9,
    Timeout = 10,
    Cancelled = 11,
    Shutdown = 12,
    Busy = 13,
    Integrity = 14,
    Version = 15,
    Internal = 16,
    Remote = 17,
    /// A key the store does not hold (a miss); per key, never for a whole call.
    NotFound = 18,
}

impl Status {
    /// Every status, in code order (index == code).
    pub const ALL: [Status; 19] = [
        Status::Ok,
        Status::Pending,
        Status::InvalidArg,
        Status::OutOfRange,
        Status::Incompatible,
        Status::Unsupported,
        Status::NoDevice,
        Status::Cuda,
        Status::Io,
        Status::NoMemory,
        Status::Timeout,
        Status::Cancelled,
        Status::Shutdown,
        Status::Busy,
        Status::Integrity,
        Status::Version,
        Status::Internal,
        Status::Remote,
        Status::NotFound,
    ];

    pub fn code(self) -> u32 {
        self as u32
    }

    pub fn from_code(code: u32) -> Option<Status> {
        Status::ALL.get(code as usize).copied()
    }

    /// The C constant's name, e.g. `"KVX_ERR_IO"`.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "KVX_OK",
            Status::Pending => "KVX_PENDING",
            Status::InvalidArg => "KVX_ERR_INVALID_ARG",
            Status::OutOfRange => "KVX_ERR_OUT_OF_RANGE",
            Status::Incompatible => "KVX_ERR_INCOMPATIBLE",
            Status::Unsupported => "KVX_ERR_UNSUPPORTED",
            Status::NoDevice => "KVX_ERR_NO_DEVICE",
            Status::Cuda => "KVX_ERR_CUDA",
            Status::Io => "KVX_ERR_IO",
            Status::NoMemory => "KVX_ERR_NO_MEMORY",
            Status::Timeout => "KVX_ERR_TIMEOUT",
            Status::Cancelled => "KVX_ERR_CANCELLED",
            Status::Shutdown => "KVX_ERR_SHUTDOWN",
            Status::Busy => "KVX_ERR_BUSY",
            Status::Integrity => "KVX_ERR_INTEGRITY",
            Status::Version => "KVX_ERR_VERSION",
            Status::Internal => "KVX_ERR_INTERNAL",
            Status::Remote => "KVX_ERR_REMOTE",
            Status::NotFound => "KVX_ERR_NOT_FOUND",
        }
    }
}

/// A failure: its status code and a message for the person reading the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    /// Wraps an OS error from a system call, naming what was being done.
    pub fn io(what: impl fmt::Display, err: std::io::Error) -> Error {
        let status = if err.raw_os_error() == Some(libc::ENOMEM) { Status::NoMemory } else { Status::Io };
        Error::new(status, format!("{what}: {err}"))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `return Err(Error::new(status, format!(...)))` in one line.
macro_rules! bail {
    ($status:ident, $($fmt:tt)+) => {
        return Err($crate::error::Error::new($crate::error::Status::$status, format!($($fmt)+)))
    };
}
pub(crate) use bail;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_dense_and_round_trip() {
        for (i, s) in Status::ALL.iter().enumerate() {
            assert_eq!(s.code() as usize, i);
            assert_eq!(Status::from_code(i as u32), Some(*s));
        }
        assert_eq!(Status::from_code(19), None);
    }
}
