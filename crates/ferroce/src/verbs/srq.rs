//! Shared receive queues: receive requests any attached QP can consume.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ferroce_proto::{PostError, RecvWr};

use crate::error::Result;

#[derive(Debug)]
pub(crate) struct SrqInner {
    queue: Mutex<VecDeque<RecvWr>>,
    max_wr: usize,
    max_sge: usize,
}

impl SrqInner {
    pub(crate) fn pop(&self) -> Option<RecvWr> {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }
}

/// A shared receive queue: receive requests any attached QP can consume.
#[derive(Debug, Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl SharedReceiveQueue {
    pub(crate) fn new(max_wr: usize, max_sge: usize) -> SharedReceiveQueue {
        SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                queue: Mutex::new(VecDeque::new()),
                max_wr,
                max_sge,
            }),
        }
    }

    /// Posts a receive request.
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        if wr.sgl.len() > self.inner.max_sge {
            return Err(PostError::TooManySge {
                given: wr.sgl.len(),
                max: self.inner.max_sge as u32,
            }
            .into());
        }
        let mut q = self.inner.queue.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= self.inner.max_wr {
            return Err(PostError::QueueFull(self.inner.max_wr as u32).into());
        }
        q.push_back(wr);
        Ok(())
    }

    /// Receive requests waiting.
    pub fn len(&self) -> usize {
        self.inner
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
