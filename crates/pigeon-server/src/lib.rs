//! pigeon-server
