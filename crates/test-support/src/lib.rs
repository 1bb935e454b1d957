//! One rule for a test whose prerequisite this machine lacks: root (network namespaces, raw
//! sockets, ethtool), or an installed tool (Open MPI's `mpirun`, ...).
//!
//! On a developer's machine the test prints one line naming what is missing and how to get it,
//! and returns (it passes, having checked nothing). Under CI (the `CI` environment variable is
//! `true` or `1`, as CI services set it) the same absence panics: `scripts/test.sh` installs
//! every tool the tests use and CI runs it as root, so there a missing prerequisite is a broken
//! set-up, and a suite that reports green over tests that never ran would hide it.

pub mod hosts;

/// Whether this run is CI's: the `CI` environment variable is `true` (any case) or `1`.
pub fn in_ci() -> bool {
    means_ci(std::env::var("CI").ok().as_deref())
}

fn means_ci(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Whether this process's effective user id is 0. Read from `/proc/self/status` (its `Uid:`
/// line lists real, effective, saved and filesystem ids), which needs no `unsafe`.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().any(|l| {
            l.strip_prefix("Uid:")
                .and_then(|ids| ids.split_whitespace().nth(1))
                == Some("0")
        })
    })
}

/// Whether `test` may go on: true when its prerequisite is `present`. When it is not, under
/// CI this panics with a message naming `what` is missing and `how` `scripts/test.sh` provides
/// it; elsewhere it prints `<test>: skipped: needs <what> (<how>)` and returns false, and the
/// test returns.
#[must_use]
#[track_caller]
pub fn require(present: bool, test: &str, what: &str, how: &str) -> bool {
    decide(present, in_ci(), test, what, how)
}

/// [`require`] for root: `why` says what the test does with it ("network namespaces").
#[must_use]
#[track_caller]
pub fn require_root(test: &str, why: &str) -> bool {
    require(
        is_root(),
        test,
        &format!("root for {why}"),
        "run scripts/test.sh as root, as CI does",
    )
}

// Callers are tracked through to the panic, so that it points at the test, not at this file.
#[track_caller]
fn decide(present: bool, ci: bool, test: &str, what: &str, how: &str) -> bool {
    if present {
        return true;
    }
    if ci {
        panic!(
            "{test}: needs {what}, which this machine lacks ({how}); \
             under CI (CI=true) a missing prerequisite is a failure, not a skip"
        );
    }
    println!("{test}: skipped: needs {what} ({how})");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_is_true_or_1_only() {
        for v in ["true", "TRUE", "True", "1"] {
            assert!(means_ci(Some(v)), "{v}");
        }
        for v in [
            None,
            Some(""),
            Some("0"),
            Some("false"),
            Some("yes"),
            Some(" true"),
        ] {
            assert!(!means_ci(v), "{v:?}");
        }
    }

    #[test]
    fn a_present_prerequisite_goes_on_in_and_out_of_ci() {
        assert!(decide(true, false, "t", "x", "y"));
        assert!(decide(true, true, "t", "x", "y"));
    }

    #[test]
    fn a_missing_prerequisite_skips_outside_ci() {
        assert!(!decide(false, false, "t", "root", "run as root"));
    }

    #[test]
    fn a_missing_prerequisite_fails_under_ci_naming_what_and_how() {
        let err = std::panic::catch_unwind(|| {
            decide(
                false,
                true,
                "launched_by_mpirun",
                "mpirun.openmpi",
                "scripts/test.sh installs openmpi-bin",
            )
        })
        .expect_err("a missing prerequisite under CI must panic");
        let msg = err
            .downcast_ref::<String>()
            .expect("a formatted panic message");
        assert!(
            msg.starts_with("launched_by_mpirun: needs mpirun.openmpi"),
            "{msg}"
        );
        assert!(
            msg.contains("scripts/test.sh installs openmpi-bin"),
            "{msg}"
        );
        assert!(msg.contains("CI=true"), "{msg}");
    }

    #[test]
    fn root_is_read_as_the_effective_uid() {
        // The `Uid:` line's effective id, read independently through /proc/self's owner
        // (the kernel makes a process's /proc directory owned by its effective uid).
        use std::os::unix::fs::MetadataExt;
        let euid = std::fs::metadata("/proc/self").unwrap().uid();
        assert_eq!(is_root(), euid == 0);
    }
}
