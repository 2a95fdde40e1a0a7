//! The presence port: which node and connection holds each device of each user. The edge
//! that accepts a connection says so, and says when it ends; what must know whether a user
//! is online anywhere (the offline hook), or where to push (a cluster's push stage), asks
//! it. The embedded adapter ([`LocalPresence`]) keeps it in this process's memory; a
//! cluster's keeps it where every node sees it, with an expiry each node refreshes.

use pigeon_proto::{DeviceId, UserId};
use std::collections::HashMap;
use std::sync::RwLock;

/// Where a connection is: the node that holds it, its user, and its id on that node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionAddr {
    pub node: u16,
    pub user: UserId,
    pub id: u64,
}

/// Called by the hub while it holds a lock of its own: an adapter answers from what it
/// holds (a cache, a queue to its engine), never waits on the network inside a call, and
/// never calls back into the hub.
pub trait Presence: Send + Sync {
    /// `device` of `at.user` is connected at `at`.
    fn connected(&self, device: &DeviceId, at: ConnectionAddr);
    /// The connection at `at` has ended.
    fn disconnected(&self, at: ConnectionAddr);
    /// Where the user's devices are connected now, on any node.
    fn connections_of(&self, user: UserId) -> Vec<(DeviceId, ConnectionAddr)>;
}

const SHARDS: usize = 32;

/// One shard of [`LocalPresence`]: each user's connections, with their devices.
type Shard = RwLock<HashMap<UserId, Vec<(DeviceId, ConnectionAddr)>>>;

/// Presence within one process, sharded by user to keep lock hold times short.
pub struct LocalPresence {
    shards: Vec<Shard>,
}

impl Default for LocalPresence {
    fn default() -> Self {
        LocalPresence {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
        }
    }
}

impl LocalPresence {
    fn shard(&self, user: UserId) -> &Shard {
        &self.shards[(user.get() as usize) % SHARDS]
    }
}

impl Presence for LocalPresence {
    fn connected(&self, device: &DeviceId, at: ConnectionAddr) {
        self.shard(at.user)
            .write()
            .expect("presence lock")
            .entry(at.user)
            .or_insert_with(|| Vec::with_capacity(1))
            .push((device.clone(), at));
    }

    fn disconnected(&self, at: ConnectionAddr) {
        let mut shard = self.shard(at.user).write().expect("presence lock");
        if let Some(conns) = shard.get_mut(&at.user) {
            conns.retain(|(_, a)| *a != at);
            if conns.is_empty() {
                shard.remove(&at.user);
            }
        }
    }

    fn connections_of(&self, user: UserId) -> Vec<(DeviceId, ConnectionAddr)> {
        self.shard(user)
            .read()
            .expect("presence lock")
            .get(&user)
            .cloned()
            .unwrap_or_default()
    }
}

/// The presence port's contract, stamped onto an adapter with
/// [`presence_suite!`](crate::presence_suite!).
#[cfg(any(test, feature = "port-suites"))]
pub mod suite {
    use super::*;

    fn at(node: u16, user: u64, id: u64) -> ConnectionAddr {
        ConnectionAddr {
            node,
            user: UserId::new(user).unwrap(),
            id,
        }
    }

    fn device(d: &str) -> DeviceId {
        DeviceId::parse(d).unwrap()
    }

    /// A user's connections on every node, each with its device, until each ends; another
    /// user's are their own.
    pub fn a_users_connections_are_found_until_they_end(p: &dyn Presence) {
        let user = UserId::new(1).unwrap();
        assert!(p.connections_of(user).is_empty());
        p.connected(&device("phone"), at(0, 1, 10));
        p.connected(&device("laptop"), at(1, 1, 10));
        p.connected(&device("phone"), at(0, 2, 11));
        let mut found = p.connections_of(user);
        found.sort_by_key(|(_, a)| (a.node, a.id));
        assert_eq!(
            found,
            vec![
                (device("phone"), at(0, 1, 10)),
                (device("laptop"), at(1, 1, 10))
            ]
        );
        p.disconnected(at(0, 1, 10));
        assert_eq!(
            p.connections_of(user),
            vec![(device("laptop"), at(1, 1, 10))]
        );
        p.disconnected(at(1, 1, 10));
        assert!(p.connections_of(user).is_empty());
        assert_eq!(p.connections_of(UserId::new(2).unwrap()).len(), 1);
    }

    /// Two connections of one device (a reconnect racing its old socket) are both found;
    /// the end of one leaves the other; the end of one never registered changes nothing.
    pub fn a_devices_second_connection_is_its_own(p: &dyn Presence) {
        let user = UserId::new(5).unwrap();
        p.connected(&device("phone"), at(0, 5, 1));
        p.connected(&device("phone"), at(0, 5, 2));
        assert_eq!(p.connections_of(user).len(), 2);
        p.disconnected(at(0, 5, 99));
        p.disconnected(at(0, 5, 1));
        assert_eq!(p.connections_of(user), vec![(device("phone"), at(0, 5, 2))]);
    }
}

/// Stamps the presence suite onto an adapter: `pigeon_core::presence_suite!(fresh)`, where
/// `fn fresh() -> impl Deref<Target = impl Presence>` makes an empty one.
#[cfg(any(test, feature = "port-suites"))]
#[macro_export]
macro_rules! presence_suite {
    ($fresh:path) => {
        #[test]
        fn a_users_connections_are_found_until_they_end() {
            $crate::presence::suite::a_users_connections_are_found_until_they_end(&*$fresh());
        }

        #[test]
        fn a_devices_second_connection_is_its_own() {
            $crate::presence::suite::a_devices_second_connection_is_its_own(&*$fresh());
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Box<LocalPresence> {
        Box::default()
    }

    crate::presence_suite!(fresh);
}
