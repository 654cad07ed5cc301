//! A service's read-mostly state written once against `parking_lot` and `arc_swap`, and
//! compiled and run again with `thiscpu`'s types in their place: the port is the import, as
//! far as the semantics allow. What differs is said where it differs (a `static` lock, which
//! thiscpu cannot build in a `const`).
#![cfg(target_os = "linux")]

/// The service's code, over the names of the lock, its guards and the swappable cell.
macro_rules! config_cache {
    (
        $RwLock:ident,
        $RwLockReadGuard:ident,
        $RwLockWriteGuard:ident,
        $RwLockUpgradableReadGuard:ident,
        $MappedRwLockReadGuard:ident,
        $Cell:ident
    ) => {
        use std::collections::HashMap;
        use std::sync::Arc;
        use std::time::Duration;

        #[derive(Debug, PartialEq)]
        pub struct Config {
            pub version: u64,
            pub name: String,
        }

        pub struct Cache {
            routes: $RwLock<HashMap<String, String>>,
            config: $Cell<Config>,
        }

        impl Cache {
            pub fn new() -> Self {
                Cache {
                    routes: $RwLock::new(HashMap::new()),
                    config: $Cell::from_pointee(Config {
                        version: 1,
                        name: "first".to_owned(),
                    }),
                }
            }

            /// A borrowed view of one route, with the read lock held as long as it lives.
            pub fn route(&self, key: &str) -> Option<$MappedRwLockReadGuard<'_, String>> {
                $RwLockReadGuard::try_map(self.routes.read(), |routes| routes.get(key)).ok()
            }

            /// Inserts under an upgradable read, and reads on after downgrading.
            pub fn insert_if_missing(&self, key: &str, value: &str) -> bool {
                let routes = self.routes.upgradable_read();
                if routes.contains_key(key) {
                    return false;
                }
                let mut routes = $RwLockUpgradableReadGuard::upgrade(routes);
                routes.insert(key.to_owned(), value.to_owned());
                let routes = $RwLockWriteGuard::downgrade(routes);
                routes.contains_key(key)
            }

            pub fn route_within(&self, key: &str, patience: Duration) -> Option<String> {
                let routes = self.routes.try_read_for(patience)?;
                routes.get(key).cloned()
            }

            /// Publishes the next version; the value it replaced.
            pub fn bump(&self) -> Arc<Config> {
                self.config.rcu(|config| Config {
                    version: config.version + 1,
                    name: config.name.clone(),
                })
            }

            /// Replaces the configuration only if it is still `seen`.
            pub fn replace_if_unchanged(&self, seen: &Arc<Config>, new: Config) -> bool {
                let previous = self.config.compare_and_swap(seen, Arc::new(new));
                Arc::ptr_eq(&previous, seen)
            }

            pub fn version(&self) -> u64 {
                self.config.load().version
            }

            pub fn snapshot(&self) -> Arc<Config> {
                self.config.load_full()
            }
        }

        pub fn cell_from(config: Arc<Config>) -> $Cell<Config> {
            config.into()
        }

        /// The same behaviour, whichever types the code was compiled with.
        pub fn exercise() {
            let cache = Cache::new();
            assert!(cache.route("/").is_none());
            assert!(cache.insert_if_missing("/", "index"));
            assert!(!cache.insert_if_missing("/", "other"));
            assert_eq!(
                cache.route("/").as_deref().map(String::as_str),
                Some("index")
            );
            assert_eq!(
                cache
                    .route_within("/", Duration::from_millis(10))
                    .as_deref(),
                Some("index")
            );

            let first = cache.snapshot();
            assert_eq!(cache.bump().version, 1);
            assert_eq!(cache.version(), 2);
            let stale = Config {
                version: 9,
                name: "stale".to_owned(),
            };
            assert!(!cache.replace_if_unchanged(&first, stale));
            let current = cache.snapshot();
            let next = Config {
                version: 3,
                name: "third".to_owned(),
            };
            assert!(cache.replace_if_unchanged(&current, next));
            assert_eq!(cache.version(), 3);

            let cell = cell_from(Arc::new(Config {
                version: 7,
                name: "from an Arc".to_owned(),
            }));
            assert_eq!(cell.load().version, 7);
        }
    };
}

mod with_parking_lot_and_arc_swap {
    use arc_swap::ArcSwap;
    use parking_lot::{
        MappedRwLockReadGuard, RwLock, RwLockReadGuard, RwLockUpgradableReadGuard, RwLockWriteGuard,
    };
    config_cache!(
        RwLock,
        RwLockReadGuard,
        RwLockWriteGuard,
        RwLockUpgradableReadGuard,
        MappedRwLockReadGuard,
        ArcSwap
    );
}

mod with_thiscpu {
    use thiscpu::{
        EpochCell, MappedRwLockReadGuard, RwLock, RwLockReadGuard, RwLockUpgradableReadGuard,
        RwLockWriteGuard,
    };
    config_cache!(
        RwLock,
        RwLockReadGuard,
        RwLockWriteGuard,
        RwLockUpgradableReadGuard,
        MappedRwLockReadGuard,
        EpochCell
    );
}

#[test]
fn the_service_behaves_the_same_on_parking_lot_and_arc_swap() {
    with_parking_lot_and_arc_swap::exercise();
}

#[test]
fn the_service_behaves_the_same_on_thiscpu() {
    with_thiscpu::exercise();
}

/// A lock in a `static`: parking_lot's constructor is `const`; thiscpu's allocates its
/// reader counts, so the static is a `LazyLock` (the difference the port cannot hide).
#[test]
fn a_static_lock_is_const_there_and_lazy_here() {
    static THEIRS: parking_lot::RwLock<Vec<String>> = parking_lot::RwLock::new(Vec::new());
    static OURS: std::sync::LazyLock<thiscpu::RwLock<Vec<String>>> =
        std::sync::LazyLock::new(|| thiscpu::RwLock::new(Vec::new()));
    THEIRS.write().push("a".to_owned());
    OURS.write().push("a".to_owned());
    assert_eq!(*THEIRS.read(), *OURS.read());
}
