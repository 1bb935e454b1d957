//! Connection management (being written).
