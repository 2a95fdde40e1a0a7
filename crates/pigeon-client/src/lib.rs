//! pigeon-client
