//! The host's memory as the kernel reckons it (`/proc/meminfo`): what the warm pools
//! size against, so that waiting sandboxes never take what a create needs.

/// `MemAvailable` in MiB: what can be used without swapping. `None` where the kernel
/// does not say (then nothing is held back for it).
pub fn available_mib() -> Option<u64> {
    field("MemAvailable:")
}

/// `MemTotal` in MiB.
pub fn total_mib() -> Option<u64> {
    field("MemTotal:")
}

fn field(name: &str) -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse(&meminfo, name)
}

fn parse(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_kernels_fields_in_mib() {
        let meminfo = "MemTotal:       24558080 kB\nMemFree:        23000000 kB\nMemAvailable:   23500000 kB\n";
        assert_eq!(super::parse(meminfo, "MemTotal:"), Some(23982));
        assert_eq!(super::parse(meminfo, "MemAvailable:"), Some(22949));
        assert_eq!(super::parse(meminfo, "Nope:"), None);
        assert!(super::available_mib().is_some_and(|a| a <= super::total_mib().expect("MemTotal")));
    }
}
