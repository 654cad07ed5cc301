//! The example service end to end: its `/metrics`, scraped over TCP while threads add, never
//! shows more than was added nor goes backwards, and once they stop shows every add.

#[allow(dead_code)]
#[path = "../examples/otel_service.rs"]
mod service;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const THREADS: usize = 4;
const REQUESTS_PER_THREAD: usize = 50_000;

#[test]
fn scrapes_over_tcp_find_exact_totals() {
    let registry = prometheus::Registry::new();
    let (_provider, requests) = service::instrument(&registry);
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = listener.local_addr().expect("the bound address");
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let (registry, stop) = (registry.clone(), stop.clone());
        std::thread::spawn(move || service::serve(listener, registry, stop))
    };

    let mut expected: BTreeMap<String, u64> = BTreeMap::new();
    for t in 0..THREADS {
        for i in 0..REQUESTS_PER_THREAD {
            *expected
                .entry(service::ROUTES[(t + i) % service::ROUTES.len()].to_owned())
                .or_default() += 1;
        }
    }
    let scrapes_done = AtomicUsize::new(0);
    let adders_done = AtomicBool::new(false);
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (requests, scrapes_done) = (&requests, &scrapes_done);
                s.spawn(move || {
                    for i in 0..REQUESTS_PER_THREAD {
                        // Half way, wait for two scrapes to have happened while adding.
                        if i == REQUESTS_PER_THREAD / 2 {
                            while scrapes_done.load(Ordering::Acquire) < 2 {
                                std::thread::yield_now();
                            }
                        }
                        service::handle(requests, service::ROUTES[(t + i) % service::ROUTES.len()]);
                    }
                })
            })
            .collect();
        let scraper = s.spawn(|| {
            let mut scrapes = Vec::new();
            while !adders_done.load(Ordering::Acquire) {
                let body = service::scrape(addr).expect("a scrape");
                scrapes.push(service::request_counts(&body));
                scrapes_done.fetch_add(1, Ordering::Release);
            }
            scrapes
        });
        for worker in workers {
            worker.join().expect("worker");
        }
        adders_done.store(true, Ordering::Release);
        let scrapes = scraper.join().expect("scraper");
        assert!(scrapes.len() >= 2, "{} scrapes", scrapes.len());
        for scrape in scrapes {
            for (route, count) in scrape {
                let ceiling = expected[&route];
                assert!(count <= ceiling, "{route}: {count} > {ceiling} added");
                let before = last.insert(route.clone(), count).unwrap_or(0);
                assert!(count >= before, "{route}: went from {before} to {count}");
            }
        }
    });

    let body = service::scrape(addr).expect("the final scrape");
    let found: BTreeMap<String, u64> = service::request_counts(&body).into_iter().collect();
    assert_eq!(found, expected, "{body}");
    stop.store(true, Ordering::Release);
    server.join().expect("server");
}
