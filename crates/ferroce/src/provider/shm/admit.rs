//! The one check every same-host one-sided access passes before it touches a peer's memory.
//!
//! A WRITE, READ or atomic done by the initiator itself (see `direct` and `shortcut`) must be
//! refused exactly where the target's responder would refuse it on the wire: the peer QP does
//! not serve requests (not RTR, RTS or SQD) or has the right disabled; the region is in another
//! protection domain, does not grant the right, or does not hold the whole range. Both paths —
//! the full one through [`super::PeerMemory::resolve`] and a sender's remembered
//! [`super::shortcut::Shortcut`] — call [`admit_one_sided`], so the rule exists once and one
//! test walks every refusal. A refused access touches nothing and takes the packet path, where
//! the peer's responder answers it with the IBTA status.

use ferroce_proto::Access;

use super::pages::state_serves;

/// What the peer QP's page says now (its state code, enabled rights and protection domain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PeerQpWords {
    pub(super) state: u32,
    pub(super) access: u32,
    pub(super) pd: u32,
}

/// What a region's key-table slot grants: its protection domain, rights, and where it lies as
/// the peer names addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Grant {
    pub(super) pd: u32,
    pub(super) access: Access,
    pub(super) addr: u64,
    pub(super) len: u64,
}

/// The offset of `addr` in the region if an access needing `need` to `addr..addr + len`
/// through the peer QP `qp` may touch `region`; `None` otherwise (see the module doc).
#[inline(always)]
pub(super) fn admit_one_sided(
    qp: PeerQpWords,
    region: &Grant,
    need: Access,
    addr: u64,
    len: u64,
) -> Option<u64> {
    let allowed = state_serves(qp.state)
        && Access::from_bits(qp.access).contains(need)
        && qp.pd == region.pd
        && region.access.contains(need);
    if !allowed {
        return None;
    }
    let off = addr.checked_sub(region.addr)?;
    (off.checked_add(len)? <= region.len).then_some(off)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RTS: u32 = 3;

    fn qp() -> PeerQpWords {
        PeerQpWords {
            state: RTS,
            access: Access::REMOTE_WRITE
                .with(Access::REMOTE_READ)
                .with(Access::REMOTE_ATOMIC)
                .bits(),
            pd: 7,
        }
    }

    fn region() -> Grant {
        Grant {
            pd: 7,
            access: Access::REMOTE_WRITE.with(Access::REMOTE_READ),
            addr: 0x10_000,
            len: 4096,
        }
    }

    #[test]
    fn the_whole_region_is_admitted_with_its_offsets() {
        let w = Access::REMOTE_WRITE;
        assert_eq!(admit_one_sided(qp(), &region(), w, 0x10_000, 4096), Some(0));
        assert_eq!(
            admit_one_sided(qp(), &region(), w, 0x10_ff8, 8),
            Some(0xff8)
        );
        assert_eq!(admit_one_sided(qp(), &region(), w, 0x11_000, 0), Some(4096));
        for state in [2, 3, 4] {
            let q = PeerQpWords { state, ..qp() };
            assert!(
                admit_one_sided(q, &region(), w, 0x10_000, 1).is_some(),
                "{state}"
            );
        }
    }

    #[test]
    fn every_refusal_is_a_refusal() {
        let w = Access::REMOTE_WRITE;
        let r = region();
        let at = 0x10_000;
        // The peer QP: every state that does not serve (RESET, INIT, SQE, ERR, nonsense).
        for state in [0, 1, 5, 6, 7, u32::MAX] {
            let q = PeerQpWords { state, ..qp() };
            assert_eq!(admit_one_sided(q, &r, w, at, 8), None, "state {state}");
        }
        // The peer QP without the right, or in another protection domain.
        let no_write = PeerQpWords {
            access: Access::REMOTE_READ.bits(),
            ..qp()
        };
        assert_eq!(admit_one_sided(no_write, &r, w, at, 8), None);
        let other_pd = PeerQpWords { pd: 8, ..qp() };
        assert_eq!(admit_one_sided(other_pd, &r, w, at, 8), None);
        // The region without the right (atomics are not granted).
        assert_eq!(
            admit_one_sided(qp(), &r, Access::REMOTE_ATOMIC, at, 8),
            None
        );
        // Bounds: before the start, past the end, wrapping around.
        assert_eq!(admit_one_sided(qp(), &r, w, at - 1, 8), None);
        assert_eq!(admit_one_sided(qp(), &r, w, at + 4089, 8), None);
        assert_eq!(admit_one_sided(qp(), &r, w, at, 4097), None);
        assert_eq!(admit_one_sided(qp(), &r, w, u64::MAX - 3, 8), None);
        assert_eq!(admit_one_sided(qp(), &r, w, at + 8, u64::MAX), None);
        let high = Grant {
            addr: u64::MAX - 4095,
            ..r
        };
        assert_eq!(admit_one_sided(qp(), &high, w, u64::MAX - 7, 16), None);
        assert_eq!(admit_one_sided(qp(), &high, w, u64::MAX - 7, 8), Some(4088));
    }
}
