//! A `PerCpuAlloc`'s statistics through the library's integrations: `serde` (feature
//! `serde`).

#[cfg(feature = "serde")]
mod serialize {
    use crate::allocator::{AllocStats, CpuAllocStats};

    /// With the `serde` feature, the statistics serialize as their fields, under their names:
    /// `{"per_cpu": [{"cpu", "hits", "misses", "spills", "passed_through", "cached_objects",
    /// "cached_bytes"}, ..], "caching", "capacity_bytes", "hits_elsewhere"}`, with `null` for hits
    /// that are not counted.
    ///
    /// ```
    /// let stats = thiscpu::PerCpuAlloc::new().counting_hits().stats();
    /// let json = serde_json::to_value(&stats).unwrap();
    /// assert_eq!(json["caching"], false);
    /// assert_eq!(json["hits_elsewhere"], 0);
    /// assert_eq!(json["per_cpu"], serde_json::json!([]));
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    impl serde::Serialize for AllocStats {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let AllocStats {
                per_cpu,
                caching,
                capacity_bytes,
                hits_elsewhere,
            } = self;
            let mut state = serializer.serialize_struct("AllocStats", 4)?;
            state.serialize_field("per_cpu", per_cpu)?;
            state.serialize_field("caching", caching)?;
            state.serialize_field("capacity_bytes", capacity_bytes)?;
            state.serialize_field("hits_elsewhere", hits_elsewhere)?;
            state.end()
        }
    }

    /// With the `serde` feature, one CPU's figures serialize as their fields, under their names
    /// (see [`AllocStats`]'s `Serialize`).
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    impl serde::Serialize for CpuAllocStats {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeStruct;
            let CpuAllocStats {
                cpu,
                hits,
                misses,
                spills,
                passed_through,
                cached_objects,
                cached_bytes,
            } = self;
            let mut state = serializer.serialize_struct("CpuAllocStats", 7)?;
            state.serialize_field("cpu", cpu)?;
            state.serialize_field("hits", hits)?;
            state.serialize_field("misses", misses)?;
            state.serialize_field("spills", spills)?;
            state.serialize_field("passed_through", passed_through)?;
            state.serialize_field("cached_objects", cached_objects)?;
            state.serialize_field("cached_bytes", cached_bytes)?;
            state.end()
        }
    }
}

#[cfg(all(test, not(thiscpu_model), feature = "serde"))]
mod tests {
    use super::super::PerCpuAlloc;
    use std::alloc::{GlobalAlloc, Layout};

    /// An allocator used by one test alone (not the global one), after it allocated, spilled
    /// and cached objects of several sizes, so that every figure it reports is settled and
    /// most are not zero.
    fn churned() -> &'static PerCpuAlloc {
        // Room for one 4096-byte object per class and CPU: the largest class spills.
        let allocator = Box::leak(Box::new(
            PerCpuAlloc::new()
                .with_cache_bytes(4096 * super::super::classes::CLASSES)
                .counting_hits(),
        ));
        for size in [24, 100, 4096] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            for _ in 0..3 {
                let objects: Vec<*mut u8> = (0..20)
                    // SAFETY: a non-zero layout; every object is freed with it below.
                    .map(|_| unsafe { allocator.alloc(layout) })
                    .collect();
                for object in objects {
                    assert!(!object.is_null());
                    // SAFETY: made with `layout` just above.
                    unsafe { allocator.dealloc(object, layout) };
                }
            }
        }
        let stats = allocator.stats();
        if stats.caching {
            assert!(stats.misses() > 0 && stats.spills() > 0, "{stats:?}");
            assert!(
                stats.hits() > Some(0) && stats.cached_bytes() > 0,
                "{stats:?}"
            );
        }
        allocator
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serialized_stats_are_the_stats() {
        let stats = churned().stats();
        let per_cpu: Vec<serde_json::Value> = stats
            .per_cpu
            .iter()
            .map(|cpu| {
                serde_json::json!({
                    "cpu": cpu.cpu,
                    "hits": cpu.hits,
                    "misses": cpu.misses,
                    "spills": cpu.spills,
                    "passed_through": cpu.passed_through,
                    "cached_objects": cpu.cached_objects,
                    "cached_bytes": cpu.cached_bytes,
                })
            })
            .collect();
        let expected = serde_json::json!({
            "per_cpu": per_cpu,
            "caching": stats.caching,
            "capacity_bytes": stats.capacity_bytes,
            "hits_elsewhere": stats.hits_elsewhere,
        });
        assert_eq!(serde_json::to_value(&stats).unwrap(), expected);
        let uncounted = serde_json::to_value(PerCpuAlloc::new().stats()).unwrap();
        assert_eq!(uncounted["hits_elsewhere"], serde_json::Value::Null);
    }
}
