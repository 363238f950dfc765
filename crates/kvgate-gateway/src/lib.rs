//! kvgate-gateway: placeholder, filled in by its issue.
