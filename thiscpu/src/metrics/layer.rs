//! [`PerCpuLayer`]: per-CPU counters in front of another recorder, published to it as totals.

use super::{KeyMap, PerCpuRecorder};
use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Level, Metadata, Recorder, SharedString, Unit,
};
use metrics_util::layers::Layer;
use std::sync::{Arc, Condvar, Mutex, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// The metadata under which published counters are registered with the inner recorder: the
/// layer registers them when it publishes, not where the program's `counter!` ran.
static PUBLISH_METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// A [`metrics_util::layers::Layer`] that makes every counter per-CPU in front of any recorder
/// (an exporter's, typically), and publishes each counter's total to the inner recorder's
/// counter of the same key with `absolute`.
///
/// - **Counters** become [`PerCpuCounter`](super::PerCpuCounter)s (with the per-thread handle
///   cache of [`PerCpuRecorder`]): `counter!(..).increment(n)` is one restartable add on the
///   current CPU, no atomic and no call into the inner recorder.
/// - **Publishing** happens from one background thread every [`interval`](PerCpuLayer::interval)
///   (default [`PerCpuLayer::DEFAULT_INTERVAL`]), and whenever [`Publisher::flush`] is called: before a
///   scrape, at shutdown ([`Publisher::shutdown`] stops the thread and publishes a last time;
///   dropping the layered recorder also publishes a last time).
/// - **Staleness**: between publications the inner recorder lags behind the per-CPU counters
///   by at most one interval (plus the time a publication takes). After `flush` returns, the
///   inner recorder holds at least every increment that returned before `flush` was called.
/// - **Idle counters**: a counter is published only when its total changed since the last
///   publication, so a counter nobody increments any more stops updating the inner recorder,
///   whose idle handling then applies as if the program had stopped touching it (for example
///   `PrometheusBuilder::idle_timeout` removes it). If it counts again, the next publication
///   registers it again and sets its full total. The layer itself keeps every counter key it
///   ever saw, with its per-CPU words, for the life of the recorder.
/// - **Gauges and histograms** pass through to the inner recorder unchanged (its buckets or
///   quantiles apply), as do descriptions.
/// - The inner recorder sees a counter once it is first published, registered with this
///   module's metadata (target `thiscpu::metrics::layer`, level INFO), not the call site's.
///
/// ```
/// use metrics_util::layers::Layer;
/// use thiscpu::metrics::PerCpuLayer;
///
/// let inner = thiscpu::metrics::PerCpuRecorder::new(); // in a service: an exporter's recorder
/// let layered = PerCpuLayer::new().interval(std::time::Duration::from_secs(5)).layer(inner.clone());
/// let publisher = layered.publisher();
/// metrics::with_local_recorder(&layered, || metrics::counter!("requests").increment(3));
/// assert_eq!(inner.snapshot().counter("requests"), None); // not published yet
/// publisher.flush(); // as before a scrape
/// assert_eq!(inner.snapshot().counter("requests"), Some(3));
/// ```
#[derive(Clone, Debug)]
pub struct PerCpuLayer {
    interval: Option<Duration>,
}

impl PerCpuLayer {
    /// How often the background thread publishes unless told otherwise.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

    /// A layer that publishes every [`Self::DEFAULT_INTERVAL`] from a background thread.
    #[must_use]
    pub fn new() -> Self {
        PerCpuLayer {
            interval: Some(Self::DEFAULT_INTERVAL),
        }
    }

    /// Publishes every `every` instead (a zero interval is taken as one millisecond).
    #[must_use]
    pub fn interval(self, every: Duration) -> Self {
        PerCpuLayer {
            interval: Some(every.max(Duration::from_millis(1))),
        }
    }

    /// Starts no background thread: counters reach the inner recorder only through
    /// [`Publisher::flush`] (and when the layered recorder is dropped).
    ///
    /// ```
    /// use metrics_util::layers::Layer;
    /// let inner = thiscpu::metrics::PerCpuRecorder::new();
    /// let layered = thiscpu::metrics::PerCpuLayer::new().on_demand_only().layer(inner.clone());
    /// metrics::with_local_recorder(&layered, || metrics::counter!("jobs").increment(1));
    /// drop(layered); // publishes a last time
    /// assert_eq!(inner.snapshot().counter("jobs"), Some(1));
    /// ```
    #[must_use]
    pub fn on_demand_only(self) -> Self {
        PerCpuLayer { interval: None }
    }
}

impl Default for PerCpuLayer {
    fn default() -> Self {
        PerCpuLayer::new()
    }
}

impl<R: Recorder + Send + Sync + 'static> Layer<R> for PerCpuLayer {
    type Output = PerCpuLayered<R>;

    fn layer(&self, inner: R) -> PerCpuLayered<R> {
        let shared = Arc::new(LayerShared {
            inner,
            counters: PerCpuRecorder::new(),
            published: Mutex::default(),
            stop: Arc::new(Stop::default()),
            thread: Mutex::new(None),
        });
        if let Some(every) = self.interval {
            let weak = Arc::downgrade(&shared);
            let stop = shared.stop.clone();
            let spawned = std::thread::Builder::new()
                .name("thiscpu-publish".into())
                .spawn(move || publish_every(every, &weak, &stop));
            // Without a thread (the system refused one), publishing on demand still works.
            if let Ok(handle) = spawned {
                *shared.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
            }
        }
        PerCpuLayered { shared }
    }
}

fn publish_every<R: Recorder>(every: Duration, shared: &Weak<LayerShared<R>>, stop: &Stop) {
    while !stop.wait(every) {
        match shared.upgrade() {
            Some(shared) => shared.publish(),
            None => return,
        }
    }
}

#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    wake: Condvar,
}

impl Stop {
    /// Waits for `timeout` or until stopped; true when stopped.
    fn wait(&self, timeout: Duration) -> bool {
        let stopped = self.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        let (stopped, _) = self
            .wake
            .wait_timeout_while(stopped, timeout, |stopped| !*stopped)
            .unwrap_or_else(PoisonError::into_inner);
        *stopped
    }

    fn stop(&self) {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.wake.notify_all();
    }
}

struct LayerShared<R: Recorder> {
    inner: R,
    counters: PerCpuRecorder,
    /// The total last published for each counter; its lock also keeps publications in order.
    published: Mutex<KeyMap<u64>>,
    stop: Arc<Stop>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<R: Recorder> LayerShared<R> {
    fn publish(&self) {
        let counters: Vec<(Key, Arc<super::PerCpuCounter>)> = self
            .counters
            .shared
            .counters
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(key, counter)| (key.clone(), counter.clone()))
            .collect();
        let mut published = self
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (key, counter) in counters {
            // Read under the lock: publications in order see non-decreasing totals, so the
            // inner counter never goes back.
            let total = counter.value();
            if published.get(&key) == Some(&total) {
                continue;
            }
            // Registered again each time: an inner recorder may have dropped an idle counter,
            // and a handle kept from before would then update nothing.
            self.inner
                .register_counter(&key, &PUBLISH_METADATA)
                .absolute(total);
            published.insert(key, total);
        }
    }

    /// Stops the background thread (waiting for it, unless called from it).
    fn stop_thread(&self) {
        self.stop.stop();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread
            && thread.thread().id() != std::thread::current().id()
        {
            let _ = thread.join();
        }
    }
}

impl<R: Recorder> Drop for LayerShared<R> {
    fn drop(&mut self) {
        // Whoever drops the last reference (the recorder, a publisher, or the thread while it
        // publishes) stops the thread and publishes a last time.
        self.stop_thread();
        self.publish();
    }
}

/// The recorder a [`PerCpuLayer`] makes: per-CPU counters in front of `R`.
///
/// Install it as the global recorder (`metrics::set_global_recorder`) after taking a
/// [`publisher`](PerCpuLayered::publisher) to flush it.
pub struct PerCpuLayered<R: Recorder + Send + Sync + 'static> {
    shared: Arc<LayerShared<R>>,
}

impl<R: Recorder + Send + Sync + 'static> PerCpuLayered<R> {
    /// A handle that publishes the counters to the inner recorder on demand.
    #[must_use]
    pub fn publisher(&self) -> Publisher<R> {
        Publisher {
            shared: self.shared.clone(),
        }
    }

    /// The inner recorder.
    #[must_use]
    pub fn inner(&self) -> &R {
        &self.shared.inner
    }
}

impl<R: Recorder + Send + Sync + 'static> core::fmt::Debug for PerCpuLayered<R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PerCpuLayered")
            .field("counters", &self.shared.counters)
            .finish_non_exhaustive()
    }
}

impl<R: Recorder + Send + Sync + 'static> Recorder for PerCpuLayered<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.shared.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.shared.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.shared.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.shared.counters.register_counter(key, metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.shared.inner.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.shared.inner.register_histogram(key, metadata)
    }
}

/// Publishes a [`PerCpuLayered`] recorder's counters to its inner recorder on demand; clones
/// share the recorder, and keep it alive.
pub struct Publisher<R: Recorder + Send + Sync + 'static> {
    shared: Arc<LayerShared<R>>,
}

impl<R: Recorder + Send + Sync + 'static> Publisher<R> {
    /// Publishes every counter whose total changed since the last publication. Once it
    /// returns, the inner recorder holds at least every increment that returned before the
    /// call. Call it before rendering a scrape.
    pub fn flush(&self) {
        self.shared.publish();
    }

    /// Stops the background thread, waits for it, and publishes a last time. Increments made
    /// after it are published only by later [`flush`](Publisher::flush)es. Call it at the
    /// end of a program whose layered recorder is installed globally (and so never dropped).
    pub fn shutdown(&self) {
        self.shared.stop_thread();
        self.shared.publish();
    }
}

impl<R: Recorder + Send + Sync + 'static> Clone for Publisher<R> {
    fn clone(&self) -> Self {
        Publisher {
            shared: self.shared.clone(),
        }
    }
}

impl<R: Recorder + Send + Sync + 'static> core::fmt::Debug for Publisher<R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Publisher").finish_non_exhaustive()
    }
}
