//! Whether the index's heap can be backed by transparent huge pages, said once at start-up:
//! the index's tables are probed at random, and on a built index huge pages made writes and
//! lookups about 9% faster on the test VM (docs/BENCHMARKS.md, session 20).

/// Where the kernel's transparent huge pages setting is.
const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// What the kernel and glibc do with the heap's pages.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HugePages {
    /// The kernel backs all anonymous memory with huge pages where it can.
    Always,
    /// The kernel gives them on request, and glibc asks (`glibc.malloc.hugetlb=1`).
    Asked,
    /// The kernel gives them on request, and nothing asks.
    NotAsked,
    /// The kernel gives none.
    Never,
    /// glibc maps the heap from the kernel's reserved pool of huge pages
    /// (`glibc.malloc.hugetlb=2`), whatever the transparent setting says.
    Reserved,
}

/// The kernel's setting (`always [madvise] never`: the bracketed word is in force) with glibc's
/// tunables (`GLIBC_TUNABLES`, `name=value` pairs joined by `:`); `None` if the setting is not
/// understood.
pub(crate) fn state(thp_enabled: &str, glibc_tunables: Option<&str>) -> Option<HugePages> {
    let mode = thp_enabled.split_whitespace().find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))?;
    let hugetlb =
        glibc_tunables.and_then(|t| t.split(':').rev().find_map(|kv| kv.strip_prefix("glibc.malloc.hugetlb="))).unwrap_or("0");
    match (mode, hugetlb) {
        (_, "2") => Some(HugePages::Reserved),
        ("always", _) => Some(HugePages::Always),
        ("madvise", "1") => Some(HugePages::Asked),
        ("madvise", _) => Some(HugePages::NotAsked),
        ("never", _) => Some(HugePages::Never),
        _ => None,
    }
}

/// Logs whether the heap gets huge pages, with what to set when it could and does not.
pub(crate) fn log_state() {
    let Ok(enabled) = std::fs::read_to_string(THP_ENABLED) else { return };
    let tunables = std::env::var("GLIBC_TUNABLES").ok();
    match state(&enabled, tunables.as_deref()) {
        Some(HugePages::Always) => tracing::info!("transparent huge pages: always"),
        Some(HugePages::Asked) => tracing::info!("transparent huge pages: on request, asked for by glibc"),
        Some(HugePages::NotAsked) => tracing::info!(
            "transparent huge pages: on request, and nothing asks; start kvindex with \
             GLIBC_TUNABLES=glibc.malloc.hugetlb=1 for faster writes and lookups (docs/OPERATIONS.md, Huge pages)"
        ),
        Some(HugePages::Never) => tracing::info!("transparent huge pages: off on this host"),
        Some(HugePages::Reserved) => tracing::info!("huge pages: glibc maps the heap from the reserved pool"),
        None => tracing::debug!(setting = enabled.trim(), "transparent huge pages: setting not understood"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_mode_in_brackets_and_glibc_tunables_decide() {
        assert_eq!(state("[always] madvise never\n", None), Some(HugePages::Always));
        assert_eq!(state("always [madvise] never\n", None), Some(HugePages::NotAsked));
        assert_eq!(state("always [madvise] never", Some("glibc.malloc.hugetlb=1")), Some(HugePages::Asked));
        assert_eq!(
            state("always [madvise] never", Some("glibc.malloc.mmap_threshold=16384:glibc.malloc.hugetlb=1")),
            Some(HugePages::Asked)
        );
        assert_eq!(state("always madvise [never]", Some("glibc.malloc.hugetlb=2")), Some(HugePages::Reserved));
        assert_eq!(
            state("always [madvise] never", Some("glibc.malloc.hugetlb=1:glibc.malloc.hugetlb=0")),
            Some(HugePages::NotAsked)
        );
        assert_eq!(state("always [madvise] never", Some("glibc.malloc.hugetlb=0")), Some(HugePages::NotAsked));
        assert_eq!(state("always [madvise] never", Some("glibc.malloc.hugetlb")), Some(HugePages::NotAsked));
        assert_eq!(state("always madvise [never]", Some("glibc.malloc.hugetlb=1")), Some(HugePages::Never));
        assert_eq!(state("always madvise never", None), None);
        assert_eq!(state("", None), None);
    }
}
