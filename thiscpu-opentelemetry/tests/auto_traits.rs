//! The auto traits of the crate's public types: instruments are shared by every thread that
//! adds and by the collector's thread, and a handle held in a `static` or moved into a task
//! must stay usable there, so each of them must stay `Send` and `Sync` whatever their private
//! fields become.

use thiscpu_opentelemetry::{
    BoundCounter, BoundUpDownCounter, PerCpuCounter, PerCpuInstrumentBuilder, PerCpuUpDownCounter,
};

fn send<T: ?Sized + Send>() {}
fn sync<T: ?Sized + Sync>() {}
fn unpin<T: ?Sized + Unpin>() {}

macro_rules! send_sync_unpin {
    ($($ty:ty),+ $(,)?) => {
        $(
            send::<$ty>();
            sync::<$ty>();
            unpin::<$ty>();
        )+
    };
}

#[test]
fn instruments_and_bound_handles_are_send_and_sync() {
    send_sync_unpin!(
        PerCpuCounter,
        PerCpuUpDownCounter,
        BoundCounter,
        BoundUpDownCounter,
        PerCpuInstrumentBuilder<'static, PerCpuCounter>,
        PerCpuInstrumentBuilder<'static, PerCpuUpDownCounter>,
    );
}
