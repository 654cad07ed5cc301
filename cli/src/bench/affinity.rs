//! The calling thread's CPU affinity: which CPUs it may run on, pinning it to one, and putting
//! its mask back afterwards. The only place in the command that calls `sched_getaffinity` and
//! `sched_setaffinity`.

/// The calling thread's affinity mask.
fn current_mask() -> std::io::Result<libc::cpu_set_t> {
    // SAFETY: `cpu_set_t` is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the kernel writes at most `size_of_val(&set)` bytes into `set`.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(set)
}

/// Sets the calling thread's affinity mask; returns whether it worked.
fn set_mask(set: &libc::cpu_set_t) -> bool {
    // SAFETY: `set` is a valid, initialized mask of the size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(set), set) == 0 }
}

/// The CPUs the calling thread may run on, lowest first (empty when the mask cannot be read).
pub fn allowed_cpus() -> Vec<u32> {
    let Ok(set) = current_mask() else {
        return Vec::new();
    };
    let bits = 8 * std::mem::size_of_val(&set);
    (0..bits)
        // SAFETY: `cpu` is below the set's size in bits.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .map(|cpu| cpu as u32)
        .collect()
}

/// Pins the calling thread to `cpu`; returns whether it worked.
pub fn pin_to(cpu: u32) -> bool {
    // SAFETY: `cpu_set_t` is a plain bit array, valid when zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu as usize >= 8 * std::mem::size_of_val(&set) {
        return false;
    }
    // SAFETY: `cpu` is below the set's size in bits (checked above).
    unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    set_mask(&set)
}

/// The calling thread's affinity, put back when dropped.
pub struct SavedAffinity(libc::cpu_set_t);

impl SavedAffinity {
    /// Reads the calling thread's affinity.
    pub fn save() -> Result<SavedAffinity, String> {
        current_mask()
            .map(SavedAffinity)
            .map_err(|error| format!("sched_getaffinity: {error}"))
    }
}

impl Drop for SavedAffinity {
    fn drop(&mut self) {
        set_mask(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_moves_the_thread_and_the_saved_mask_comes_back() {
        std::thread::spawn(|| {
            let before = allowed_cpus();
            let Some(&last) = before.last() else {
                panic!("no CPU in the affinity mask");
            };
            {
                let _saved = SavedAffinity::save().unwrap();
                assert!(pin_to(last));
                assert_eq!(allowed_cpus(), [last]);
            }
            assert_eq!(allowed_cpus(), before);
            assert!(!pin_to(u32::MAX));
        })
        .join()
        .unwrap();
    }
}
