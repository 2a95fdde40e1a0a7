//! The revocation port: a logout, once durable, is an event every node hears, so that each
//! forgets the user's token generation it remembered and ends the user's connections it
//! holds. The embedded adapter ([`LocalRevocations`]) tells the listeners of this process;
//! a cluster's carries the event to every node.

use pigeon_proto::UserId;
use std::sync::{Arc, RwLock};

/// What a node does when it hears of a revocation.
pub type Listener = Arc<dyn Fn(UserId) + Send + Sync>;

pub trait Revocations: Send + Sync {
    /// Says that `user`'s tokens were revoked. The listeners of this node have heard it
    /// when this returns; those of other nodes hear it as soon as the adapter carries it.
    fn announce(&self, user: UserId);
    /// Adds a listener: from now on it hears every revocation announced, here or elsewhere.
    fn listen(&self, listener: Listener);
}

/// Revocations within one process: `announce` calls every listener before it returns.
#[derive(Default)]
pub struct LocalRevocations {
    listeners: RwLock<Vec<Listener>>,
}

impl Revocations for LocalRevocations {
    fn announce(&self, user: UserId) {
        let listeners = self.listeners.read().expect("listeners lock").clone();
        for l in listeners {
            l(user);
        }
    }

    fn listen(&self, listener: Listener) {
        self.listeners
            .write()
            .expect("listeners lock")
            .push(listener);
    }
}

/// The revocation port's contract, stamped onto an adapter with
/// [`revocation_suite!`](crate::revocation_suite!).
#[cfg(any(test, feature = "port-suites"))]
pub mod suite {
    use super::*;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    fn recorder() -> (Listener, Arc<Mutex<Vec<u64>>>) {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let l: Listener = Arc::new(move |u: UserId| h.lock().unwrap().push(u.get()));
        (l, heard)
    }

    /// Waits up to `within` for `heard` to hold `want`.
    fn heard_within(heard: &Mutex<Vec<u64>>, want: &[u64], within: Duration) -> Vec<u64> {
        let until = Instant::now() + within;
        loop {
            let got = heard.lock().unwrap().clone();
            if got == want || Instant::now() >= until {
                return got;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every listener hears every revocation, in the order announced; one added later hears
    /// only what comes after it.
    pub fn every_listener_hears_each_revocation(r: &dyn Revocations, within: Duration) {
        let (first, first_heard) = recorder();
        let (second, second_heard) = recorder();
        r.listen(first);
        r.listen(second);
        r.announce(UserId::new(7).unwrap());
        r.announce(UserId::new(8).unwrap());
        let (late, late_heard) = recorder();
        r.listen(late);
        r.announce(UserId::new(9).unwrap());
        assert_eq!(
            heard_within(&first_heard, &[7, 8, 9], within),
            vec![7, 8, 9]
        );
        assert_eq!(
            heard_within(&second_heard, &[7, 8, 9], within),
            vec![7, 8, 9]
        );
        assert_eq!(heard_within(&late_heard, &[9], within), vec![9]);
    }

    /// A listener of the announcing node has heard the revocation when `announce` returns:
    /// a logout answers only once the user's connections there are ended.
    pub fn the_announcing_node_hears_it_before_announce_returns(r: &dyn Revocations) {
        let (l, heard) = recorder();
        r.listen(l);
        r.announce(UserId::new(3).unwrap());
        assert_eq!(*heard.lock().unwrap(), vec![3]);
    }
}

/// Stamps the revocation suite onto an adapter: `pigeon_core::revocation_suite!(fresh,
/// within)`, where `fn fresh() -> impl Deref<Target = impl Revocations>` makes a fresh one
/// and `within` is how long another listener may take to hear an event.
#[cfg(any(test, feature = "port-suites"))]
#[macro_export]
macro_rules! revocation_suite {
    ($fresh:path, $within:expr) => {
        #[test]
        fn every_listener_hears_each_revocation() {
            let r = $fresh();
            $crate::revocation::suite::every_listener_hears_each_revocation(&*r, $within);
        }

        #[test]
        fn the_announcing_node_hears_it_before_announce_returns() {
            let r = $fresh();
            $crate::revocation::suite::the_announcing_node_hears_it_before_announce_returns(&*r);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Box<LocalRevocations> {
        Box::default()
    }

    crate::revocation_suite!(fresh, std::time::Duration::ZERO);
}
