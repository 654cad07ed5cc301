//! A service that counts its requests per CPU and serves the counts to Prometheus through
//! OpenTelemetry's Prometheus exporter, on a loopback HTTP `/metrics` written on `std::net`.
//!
//! `cargo run -p thiscpu-opentelemetry --example otel_service` handles a batch of simulated
//! requests on four threads, scrapes its own `/metrics` over TCP, prints the request counts
//! and exits; with `serve` as argument it keeps serving on 127.0.0.1:9464 until killed.

use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{Encoder, TextEncoder};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use thiscpu_opentelemetry::opentelemetry::KeyValue;
use thiscpu_opentelemetry::opentelemetry::metrics::MeterProvider;
use thiscpu_opentelemetry::{PerCpuCounter, PerCpuMeterExt};

/// The routes the simulated requests go to.
pub const ROUTES: [&str; 3] = ["/", "/search", "/login"];

/// A meter provider whose only reader is the Prometheus exporter on `registry`, and the
/// service's request counter made from it.
pub fn instrument(registry: &prometheus::Registry) -> (SdkMeterProvider, PerCpuCounter) {
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()
        .expect("a Prometheus exporter on a fresh registry");
    let provider = SdkMeterProvider::builder().with_reader(exporter).build();
    let requests = provider
        .meter("otel_service")
        .percpu_u64_counter("requests")
        .with_description("Requests handled, by route")
        .build();
    (provider, requests)
}

/// Handles one simulated request: counts it under its route.
pub fn handle(requests: &PerCpuCounter, route: &'static str) {
    requests.add(1, &[KeyValue::new("route", route)]);
}

/// Answers HTTP requests on `listener` until `stop` is set: `GET /metrics` with the registry in
/// Prometheus's text format, anything else with 404. One connection at a time, one request per
/// connection: a scrape endpoint needs no more.
pub fn serve(listener: TcpListener, registry: prometheus::Registry, stop: Arc<AtomicBool>) {
    // Non-blocking accept, so that `stop` is noticed without a connection arriving.
    listener
        .set_nonblocking(true)
        .expect("a non-blocking listener");
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                // A client that misbehaves costs its connection, not the server.
                let _ = answer(stream, &registry);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("accept failed: {e}"),
        }
    }
}

fn answer(stream: TcpStream, registry: &prometheus::Registry) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // The headers end at the first empty line; no request this server answers has a body.
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim_end().is_empty() {
            break;
        }
    }
    let mut stream = reader.into_inner();
    let mut parts = request_line.split_whitespace();
    if (parts.next(), parts.next()) != (Some("GET"), Some("/metrics")) {
        return stream.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
    }
    let encoder = TextEncoder::new();
    let mut body = Vec::new();
    encoder
        .encode(&registry.gather(), &mut body)
        .map_err(std::io::Error::other)?;
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        encoder.format_type(),
        body.len()
    )?;
    stream.write_all(&body)
}

/// Fetches `http://addr/metrics` with one GET and returns the body.
pub fn scrape(addr: impl ToSocketAddrs) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no end of headers"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(std::io::Error::other(format!("not a 200: {head}")));
    }
    Ok(body.to_owned())
}

/// The `requests_total` samples of a scrape: (route, count).
pub fn request_counts(body: &str) -> Vec<(String, u64)> {
    body.lines()
        .filter(|line| line.starts_with("requests_total{"))
        .filter_map(|line| {
            let (labels, value) = line.rsplit_once(' ')?;
            let route = labels.split("route=\"").nth(1)?.split('"').next()?;
            Some((route.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn main() {
    let serve_forever = std::env::args().nth(1).as_deref() == Some("serve");
    let registry = prometheus::Registry::new();
    let (_provider, requests) = instrument(&registry);
    let port = if serve_forever { 9464 } else { 0 };
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("a loopback port");
    let addr = listener.local_addr().expect("the bound address");
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let (registry, stop) = (registry.clone(), stop.clone());
        std::thread::spawn(move || serve(listener, registry, stop))
    };
    println!("serving http://{addr}/metrics");
    std::thread::scope(|s| {
        for t in 0..4 {
            let requests = &requests;
            s.spawn(move || {
                for i in 0..100_000usize {
                    handle(requests, ROUTES[(t + i) % ROUTES.len()]);
                }
            });
        }
    });
    if serve_forever {
        server.join().expect("the server");
        return;
    }
    let body = scrape(addr).expect("a scrape of our own /metrics");
    for (route, count) in request_counts(&body) {
        println!("requests_total route={route}: {count}");
    }
    stop.store(true, Ordering::Release);
    server.join().expect("the server");
}
