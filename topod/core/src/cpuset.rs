//! `CpuSet`: a set of OS CPU ids (or NUMA node ids) as a growable bitset.
//!
//! Every domain of the hardware graph, every allocation and the free map are `CpuSet`s, so the
//! placement hot path is made of word-wide `and`/`or`/`popcount`. The set is kept normalized (no
//! trailing zero words) so that two equal sets compare equal whatever their history.
//!
//! Text forms understood, each as the kernel or hwloc writes it:
//! - list format, `0-3,8,10-11` (`cpulist`, `cpuset.cpus`, `Cpus_allowed_list`);
//! - kernel mask format, `00000000,0000ff0f` (`cpumap`, `Cpus_allowed`): 32-bit hex words,
//!   most significant first;
//! - hwloc XML bitmap format, `0x0000ffff,0xffffffff` or `0xf...f,0x000000ff` (infinite tail).

use smallvec::SmallVec;
use std::fmt;

/// Words kept inline before the set spills to the heap: 512 CPUs, more than almost any node has,
/// so the placement hot path does not allocate for sets.
const INLINE_WORDS: usize = 8;
type Words = SmallVec<[u64; INLINE_WORDS]>;

/// Upper bound on CPU ids accepted from text, so that a hostile or corrupt input such as
/// `0-4294967295` cannot make us allocate gigabytes. Linux's `NR_CPUS` maximum is 8192.
pub const MAX_CPU_ID: u32 = 65_535;

/// A set of small non-negative integers (CPU ids or NUMA node ids).
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CpuSet {
    words: Words,
}

/// A text form of a set that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad CPU set {text:?} at byte {offset}: {reason}")]
pub struct CpuSetParseError {
    /// The whole text that was being read (cut to 80 characters).
    pub text: String,
    /// Byte offset of the offending part.
    pub offset: usize,
    /// What is wrong there.
    pub reason: String,
}

impl CpuSetParseError {
    fn new(text: &str, offset: usize, reason: impl Into<String>) -> Self {
        let text: String = text.chars().take(80).collect();
        Self { text, offset, reason: reason.into() }
    }
}

impl CpuSet {
    /// The empty set.
    pub fn new() -> Self {
        Self { words: SmallVec::new() }
    }

    /// `{0, 1, ..., n-1}`.
    pub fn first_n(n: u32) -> Self {
        let mut s = Self::new();
        s.insert_range(0, n);
        s
    }

    /// Adds `id`.
    pub fn insert(&mut self, id: u32) {
        let (w, b) = ((id / 64) as usize, id % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1u64 << b;
    }

    /// Adds `start..end`.
    pub fn insert_range(&mut self, start: u32, end: u32) {
        if start >= end {
            return;
        }
        // A word at a time: a request may name `0-65535` thousands of times.
        let (first, last) = ((start / 64) as usize, ((end - 1) / 64) as usize);
        if self.words.len() <= last {
            self.words.resize(last + 1, 0);
        }
        for w in first..=last {
            let lo = if w == first { start % 64 } else { 0 };
            let hi = if w == last { (end - 1) % 64 } else { 63 };
            let bits = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            self.words[w] |= bits;
        }
    }

    /// Removes `id`.
    pub fn remove(&mut self, id: u32) {
        let w = (id / 64) as usize;
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1u64 << (id % 64));
            self.trim();
        }
    }

    /// Whether `id` is in the set.
    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.words.get((id / 64) as usize).is_some_and(|w| w & (1u64 << (id % 64)) != 0)
    }

    /// Number of members.
    #[inline]
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set has no member.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Smallest member.
    pub fn first(&self) -> Option<u32> {
        self.words
            .iter()
            .enumerate()
            .find(|(_, w)| **w != 0)
            .map(|(i, w)| i as u32 * 64 + w.trailing_zeros())
    }

    /// Largest member.
    pub fn last(&self) -> Option<u32> {
        self.words.last().map(|w| (self.words.len() as u32 - 1) * 64 + 63 - w.leading_zeros())
    }

    /// Members in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let base = i as u32 * 64;
            BitIter(w).map(move |b| base + b)
        })
    }

    /// Number of members also in `other`, without building the intersection.
    #[inline]
    pub fn intersection_len(&self, other: &CpuSet) -> usize {
        self.words.iter().zip(&other.words).map(|(a, b)| (a & b).count_ones() as usize).sum()
    }

    /// Whether the two sets share a member.
    #[inline]
    pub fn intersects(&self, other: &CpuSet) -> bool {
        self.words.iter().zip(&other.words).any(|(a, b)| a & b != 0)
    }

    /// Whether some member of `self` outside `except` is in `other` (no allocation).
    #[inline]
    pub fn intersects_outside(&self, except: &CpuSet, other: &CpuSet) -> bool {
        self.words.iter().enumerate().any(|(i, &w)| {
            w & !except.words.get(i).copied().unwrap_or(0)
                & other.words.get(i).copied().unwrap_or(0)
                != 0
        })
    }

    /// Whether every member is also in `other`.
    pub fn is_subset(&self, other: &CpuSet) -> bool {
        self.words
            .iter()
            .enumerate()
            .all(|(i, &w)| w & !other.words.get(i).copied().unwrap_or(0) == 0)
    }

    /// Whether every member of `other` is also in `self`.
    pub fn is_superset_of(&self, other: &CpuSet) -> bool {
        other.is_subset(self)
    }

    /// `self ∩ other`.
    pub fn intersection(&self, other: &CpuSet) -> CpuSet {
        let mut words: Words = self.words.iter().zip(&other.words).map(|(a, b)| a & b).collect();
        trim_words(&mut words);
        CpuSet { words }
    }

    /// `self ∪ other`.
    pub fn union(&self, other: &CpuSet) -> CpuSet {
        let mut out = self.clone();
        out.union_with(other);
        out
    }

    /// `self − other`.
    pub fn difference(&self, other: &CpuSet) -> CpuSet {
        let mut out = self.clone();
        out.difference_with(other);
        out
    }

    /// The union of all `sets`.
    pub fn union_all<'a>(sets: impl IntoIterator<Item = &'a CpuSet>) -> CpuSet {
        let mut out = CpuSet::new();
        for s in sets {
            out.union_with(s);
        }
        out
    }

    /// `self ← self ∪ other`.
    pub fn union_with(&mut self, other: &CpuSet) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
    }

    /// `self ← self − other`.
    pub fn difference_with(&mut self, other: &CpuSet) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= !b;
        }
        self.trim();
    }

    /// `self ← self ∩ other`.
    pub fn intersect_with(&mut self, other: &CpuSet) {
        self.words.truncate(other.words.len());
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= b;
        }
        self.trim();
    }

    /// The `n` smallest members (all of them if fewer).
    pub fn take_first(&self, n: usize) -> CpuSet {
        let mut out = CpuSet::new();
        for id in self.iter().take(n) {
            out.insert(id);
        }
        out
    }

    fn trim(&mut self) {
        trim_words(&mut self.words);
    }

    /// Reads the list format: `0-3,8,10-11`. Empty text (or only white space) is the empty set.
    pub fn parse_list(text: &str) -> Result<CpuSet, CpuSetParseError> {
        let mut set = CpuSet::new();
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Ok(set);
        }
        let lead = text.len() - text.trim_start().len();
        let mut offset = lead;
        for part in trimmed.split(',') {
            let item = part.trim();
            let item_offset = offset + (part.len() - part.trim_start().len());
            offset += part.len() + 1;
            if item.is_empty() {
                return Err(CpuSetParseError::new(text, item_offset, "empty item between commas"));
            }
            let (lo, hi) = match item.split_once('-') {
                Some((a, b)) => (
                    parse_id(text, item_offset, a.trim())?,
                    parse_id(text, item_offset + a.len() + 1, b.trim())?,
                ),
                None => {
                    let v = parse_id(text, item_offset, item)?;
                    (v, v)
                }
            };
            if hi < lo {
                return Err(CpuSetParseError::new(
                    text,
                    item_offset,
                    format!("range {item} runs backwards"),
                ));
            }
            set.insert_range(lo, hi + 1);
        }
        Ok(set)
    }

    /// Reads the kernel mask format: comma-separated 32-bit hex words, most significant first.
    pub fn parse_mask(text: &str) -> Result<CpuSet, CpuSetParseError> {
        let trimmed = text.trim();
        let mut set = CpuSet::new();
        if trimmed.is_empty() {
            return Ok(set);
        }
        let groups: Vec<&str> = trimmed.split(',').collect();
        let n = groups.len();
        if n as u64 * 32 > u64::from(MAX_CPU_ID) + 1 {
            return Err(CpuSetParseError::new(
                text,
                0,
                "mask is wider than the largest CPU id accepted",
            ));
        }
        let mut offset = 0;
        for (i, g) in groups.iter().enumerate() {
            let g = g.trim().trim_start_matches("0x");
            let value = u32::from_str_radix(g, 16).map_err(|_| {
                CpuSetParseError::new(text, offset, format!("{g:?} is not a 32-bit hex word"))
            })?;
            offset += groups[i].len() + 1;
            let base = ((n - 1 - i) * 32) as u32;
            for bit in BitIter(u64::from(value)) {
                set.insert(base + bit);
            }
        }
        Ok(set)
    }

    /// Reads hwloc's XML bitmap format: `0x...` 32-bit words, most significant first, where an
    /// empty word (`0x0000ffff,,0x1`) is zero; a first word of `0xf...f` means "all higher ids
    /// too", which we cut at `limit` (exclusive).
    pub fn parse_hwloc(text: &str, limit: u32) -> Result<CpuSet, CpuSetParseError> {
        let trimmed = text.trim();
        let (infinite, rest) = match trimmed.strip_prefix("0xf...f") {
            Some(rest) => (true, rest.strip_prefix(',').unwrap_or(rest)),
            None => (false, trimmed),
        };
        let groups: Vec<&str> =
            if rest.is_empty() { Vec::new() } else { rest.split(',').collect() };
        if groups.len() as u64 * 32 > u64::from(MAX_CPU_ID) + 1 {
            return Err(CpuSetParseError::new(
                text,
                0,
                "bitmap is wider than the largest CPU id accepted",
            ));
        }
        let mut set = CpuSet::new();
        let mut offset = text.len() - text.trim_start().len() + (trimmed.len() - rest.len());
        for (i, g) in groups.iter().enumerate() {
            let digits = g.trim();
            let digits = digits.strip_prefix("0x").unwrap_or(digits);
            let value = if digits.is_empty() {
                0
            } else {
                u32::from_str_radix(digits, 16).map_err(|_| {
                    CpuSetParseError::new(text, offset, format!("{g:?} is not a 32-bit hex word"))
                })?
            };
            offset += g.len() + 1;
            let base = ((groups.len() - 1 - i) * 32) as u32;
            for bit in BitIter(u64::from(value)) {
                set.insert(base + bit);
            }
        }
        if infinite {
            let from = groups.len() as u32 * 32;
            set.insert_range(from, limit.max(from));
        }
        Ok(set)
    }

    /// The kernel's mask format (as `cpuset.cpus` accepts only the list format, this is for display).
    pub fn to_mask(&self) -> String {
        if self.words.is_empty() {
            return "0".to_string();
        }
        let mut halves: Vec<u32> = Vec::new();
        for w in &self.words {
            halves.push(*w as u32);
            halves.push((*w >> 32) as u32);
        }
        while halves.len() > 1 && *halves.last().unwrap_or(&1) == 0 {
            halves.pop();
        }
        halves.iter().rev().map(|h| format!("{h:08x}")).collect::<Vec<_>>().join(",")
    }
}

fn parse_id(text: &str, offset: usize, s: &str) -> Result<u32, CpuSetParseError> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CpuSetParseError::new(text, offset, format!("{s:?} is not a CPU number")));
    }
    let v: u64 = s
        .parse()
        .map_err(|_| CpuSetParseError::new(text, offset, format!("{s:?} is too large")))?;
    if v > u64::from(MAX_CPU_ID) {
        return Err(CpuSetParseError::new(
            text,
            offset,
            format!("{v} is above the largest id accepted, {MAX_CPU_ID}"),
        ));
    }
    Ok(v as u32)
}

fn trim_words(words: &mut Words) {
    while words.last() == Some(&0) {
        words.pop();
    }
}

struct BitIter(u64);

impl Iterator for BitIter {
    type Item = u32;
    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(b)
    }
}

impl FromIterator<u32> for CpuSet {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        let mut s = CpuSet::new();
        for id in iter {
            s.insert(id);
        }
        s
    }
}

/// The list format, `0-3,8`; the empty set prints as the empty string, as the kernel does.
impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut iter = self.iter().peekable();
        while let Some(start) = iter.next() {
            let mut end = start;
            while iter.peek() == Some(&(end + 1)) {
                end = iter.next().unwrap_or(end);
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if end == start {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuSet({self})")
    }
}

impl serde::Serialize for CpuSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for CpuSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        CpuSet::parse_list(&s).map_err(serde::de::Error::custom)
    }
}

/// On the wire a CPU set is the kernel's list format (`0-3,8`, or empty).
#[cfg(feature = "schema")]
impl schemars::JsonSchema for CpuSet {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "CpuSet".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "CPU or NUMA node ids in the kernel's list format: 0-3,8 (empty for none)",
            "type": "string",
            "pattern": "^([0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)?$"
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn list_round_trip() {
        let s = CpuSet::parse_list("0-3,8,10-11").unwrap();
        assert_eq!(s.len(), 7);
        assert_eq!(s.to_string(), "0-3,8,10-11");
        assert_eq!(CpuSet::parse_list("").unwrap(), CpuSet::new());
        assert_eq!(CpuSet::parse_list(" 5\n").unwrap().to_string(), "5");
    }

    #[test]
    fn list_errors_point_at_the_item() {
        let e = CpuSet::parse_list("0-3,x,5").unwrap_err();
        assert_eq!(e.offset, 4);
        assert!(CpuSet::parse_list("4-2").unwrap_err().reason.contains("backwards"));
        assert!(CpuSet::parse_list("0-99999999").is_err());
        assert!(CpuSet::parse_list("1,,2").is_err());
    }

    #[test]
    fn masks() {
        let s = CpuSet::parse_mask("00000000,0000ff0f").unwrap();
        assert_eq!(s.to_string(), "0-3,8-15");
        let s = CpuSet::parse_mask("00000001,00000000,00000000").unwrap();
        assert_eq!(s.to_string(), "64");
        assert_eq!(s.to_mask(), "00000001,00000000,00000000");
        let h = CpuSet::parse_hwloc("0x000000ff,0xffffffff", 0).unwrap();
        assert_eq!(h.to_string(), "0-39");
        let inf = CpuSet::parse_hwloc("0xf...f,0x0000000f", 40).unwrap();
        assert_eq!(inf.to_string(), "0-3,32-39");
        let gaps = CpuSet::parse_hwloc("0x000000ff,0xff000000,,0x0", 0).unwrap();
        assert_eq!(gaps.to_string(), "88-103");
        assert!(CpuSet::parse_hwloc("0x1,0xzz", 0).is_err());
        assert!(CpuSet::parse_mask("zz").is_err());
    }

    proptest! {
        #[test]
        fn a_range_is_its_members(start in 0u32..700, len in 0u32..300, base in proptest::collection::btree_set(0u32..1000, 0..20)) {
            let mut s: CpuSet = base.iter().copied().collect();
            s.insert_range(start, start + len);
            let expected: CpuSet = base.iter().copied().chain(start..start + len).collect();
            prop_assert_eq!(s, expected);
        }

        #[test]
        fn display_parse_round_trip(ids in proptest::collection::btree_set(0u32..2000, 0..100)) {
            let s: CpuSet = ids.iter().copied().collect();
            prop_assert_eq!(CpuSet::parse_list(&s.to_string()).unwrap(), s.clone());
            prop_assert_eq!(CpuSet::parse_mask(&s.to_mask()).unwrap(), s.clone());
            prop_assert_eq!(s.len(), ids.len());
        }

        #[test]
        fn set_algebra(a in proptest::collection::btree_set(0u32..300, 0..60),
                       b in proptest::collection::btree_set(0u32..300, 0..60)) {
            let (sa, sb): (CpuSet, CpuSet) = (a.iter().copied().collect(), b.iter().copied().collect());
            let inter: CpuSet = a.intersection(&b).copied().collect();
            let uni: CpuSet = a.union(&b).copied().collect();
            let diff: CpuSet = a.difference(&b).copied().collect();
            prop_assert_eq!(sa.intersection(&sb), inter.clone());
            prop_assert_eq!(sa.union(&sb), uni);
            prop_assert_eq!(sa.difference(&sb), diff);
            prop_assert_eq!(sa.intersection_len(&sb), inter.len());
            prop_assert_eq!(sa.intersects(&sb), !inter.is_empty());
            prop_assert_eq!(inter.is_subset(&sa), true);
        }

        #[test]
        fn parse_never_panics(text in ".{0,40}") {
            let _ = CpuSet::parse_list(&text);
            let _ = CpuSet::parse_mask(&text);
            let _ = CpuSet::parse_hwloc(&text, 64);
        }
    }
}
