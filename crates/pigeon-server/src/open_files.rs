//! The process's open-file limit, and how many connections it leaves room for. Every socket
//! is a file descriptor, and so are the store's files: a journal segment opened when the
//! last one is full, SQLite's temporary files. A server that let sockets take every
//! descriptor would refuse commits (no next segment) to the clients it already serves, so
//! connections get what the limit leaves after [`RESERVED_FOR_THE_STORE`].

/// Descriptors kept back from connections: the store (journal segments, the tables, the
/// WAL and its index, up to 17 read connections (8 queries, 8 lookups, the engine's loads), SQLite's
/// temporary files), the offline webhook's client, the log, with room to spare. A low limit
/// keeps back a quarter of itself instead.
pub const RESERVED_FOR_THE_STORE: u64 = 512;

/// Raises the soft open-file limit to the hard one, as Go's runtime does at start (the
/// soft limit is often 1 024 or 256, far below what a chat server holds), and answers the
/// soft limit in force; `None` where it cannot be read.
#[cfg(unix)]
#[allow(unsafe_code)]
pub fn raise_limit() -> Option<u64> {
    /// The most macOS lets a soft limit be (`OPEN_MAX`), whatever the hard limit says.
    const MACOS_OPEN_MAX: libc::rlim_t = 10_240;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through the pointer, which points at `lim`, a
    // valid, initialised, exclusively borrowed value that outlives the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    // The hard limit, or, where that is refused (macOS's is infinite), what macOS allows.
    for want in [lim.rlim_max, lim.rlim_max.min(MACOS_OPEN_MAX)] {
        if want <= lim.rlim_cur {
            break;
        }
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the `rlimit` behind the pointer, `raised`, a valid
        // initialised value that outlives the call; it changes a limit of this process and
        // no memory.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = want;
            break;
        }
    }
    // RLIM_INFINITY is u64::MAX: as good as no limit. (`rlim_t` is u64 on Linux, not on
    // every unix.)
    #[allow(clippy::unnecessary_cast)]
    Some(lim.rlim_cur as u64)
}

#[cfg(not(unix))]
pub fn raise_limit() -> Option<u64> {
    None
}

/// The connections a limit of `open_files` descriptors leaves room for (see the module
/// documentation); `usize::MAX`, no bound of its own, where the limit is unknown.
pub fn connections_for(open_files: Option<u64>) -> usize {
    match open_files {
        Some(n) => {
            let reserved = RESERVED_FOR_THE_STORE.min(n / 4);
            usize::try_from(n - reserved).unwrap_or(usize::MAX)
        }
        None => usize::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_leave_the_store_its_descriptors() {
        assert_eq!(connections_for(Some(20_000)), 19_488);
        assert_eq!(connections_for(Some(2_048)), 1_536);
        // A low limit keeps a quarter back.
        assert_eq!(connections_for(Some(1_024)), 768);
        assert_eq!(connections_for(Some(256)), 192);
        assert_eq!(connections_for(None), usize::MAX);
        assert_eq!(connections_for(Some(u64::MAX)), usize::MAX - 512);
    }

    /// (Linux: macOS stops at `OPEN_MAX` below its infinite hard limit.)
    #[cfg(target_os = "linux")]
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        #[allow(unsafe_code)]
        // SAFETY: as in `raise_limit`: one `rlimit` written into `lim`, which outlives the call.
        let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        assert_eq!(r, 0);
        // Below the hard limit first (by one: other tests of this process open files), so
        // that the raise has something to do.
        let lowered = libc::rlimit {
            rlim_cur: lim.rlim_max.min(1 << 20).saturating_sub(1),
            rlim_max: lim.rlim_max,
        };
        #[allow(unsafe_code)]
        // SAFETY: setrlimit only reads `lowered`, a valid value that outlives the call.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) };
        assert_eq!(r, 0);
        let soft = raise_limit().expect("the limit is readable");
        #[allow(unsafe_code)]
        // SAFETY: as above.
        let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        assert_eq!(r, 0);
        #[allow(clippy::unnecessary_cast)]
        let current = lim.rlim_cur as u64;
        assert_eq!(soft, current);
        assert_eq!(lim.rlim_cur, lim.rlim_max, "raised to the hard limit");
    }
}
