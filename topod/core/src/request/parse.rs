//! The parser: request text into a [`Request`].
//!
//! The grammar and its meaning are documented on [`parse`].

use super::{
    CpusetOption, CpusetType, Distribute, Exclusive, GpuBind, Level, MemBind, Request,
    ResumeOption, Scope,
};
use crate::cpuset::CpuSet;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Largest count accepted anywhere (tasks, units per task, `pack(level=n)`, `MAX_RADIUS`,
/// `MAX_CPU_PER_NODE`).
pub const MAX_COUNT: u32 = 65_536;
/// Largest `mem=` accepted, in MiB (1 EiB).
pub const MAX_MEM_MIB: u64 = 1 << 40;
/// Longest `CPUSET_NAME` accepted, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Names of the sections, as offered in error messages.
const SECTIONS: &[&str] = &["CPUSET[", "affinity["];
/// Processor unit types and level names, with their aliases, as offered in error messages.
const LEVEL_NAMES: &[(&str, Level)] = &[
    ("numa", Level::Numa),
    ("socket", Level::Socket),
    ("core", Level::Core),
    ("thread", Level::Thread),
    ("mcm", Level::Numa),
    ("cpu", Level::Thread),
    ("l3", Level::L3),
];
const SCOPE_NAMES: &[(&str, Scope)] =
    &[("injob", Scope::InJob), ("alljobs", Scope::AllJobs), ("intask", Scope::InTask)];
const OPTION_NAMES: &[(&str, CpusetOption)] = &[
    ("CPUSET_CPU_EXCLUSIVE", CpusetOption::CpuExclusive),
    ("CPUSET_MEMORY_LOCAL", CpusetOption::MemoryLocal),
    ("CPUSET_MEMORY_EXCLUSIVE", CpusetOption::MemoryExclusive),
    ("CPUSET_MEMORY_KERNEL_AVOID", CpusetOption::MemoryKernelAvoid),
    ("CPUSET_MEMORY_MANDATORY", CpusetOption::MemoryMandatory),
    ("CPUSET_POLICY_PAGE", CpusetOption::PolicyPage),
    ("CPUSET_POLICY_KILL", CpusetOption::PolicyKill),
    ("CPUSET_EVENT_NOTIFY", CpusetOption::EventNotify),
];
const TYPE_NAMES: &[(&str, CpusetType)] =
    &[("static", CpusetType::Static), ("dynamic", CpusetType::Dynamic), ("none", CpusetType::None)];
const CLAUSES: &[&str] = &["cpubind", "membind", "distribute", "mem", "gpubind", "gpus"];
const MEMBINDS: &[&str] = &["localonly", "localprefer"];
const GPUBINDS: &[(&str, GpuBind)] =
    &[("numa", GpuBind::Numa), ("socket", GpuBind::Socket), ("any", GpuBind::Any)];
const GPUBIND_NAMES: &[&str] = &["numa", "socket", "any"];
const DISTRIBUTIONS: &[&str] = &["pack", "pack(level=n)", "balance", "any"];
const UNIT_OPTIONS: &[&str] = &["same", "exclusive"];
const NUMBER: &[&str] = &["a whole number"];
const SIZE: &[&str] = &["a size such as 512M, 4G (binary units K, M, G, T; no unit: MiB)"];

/// Why a request string was refused, and where.
///
/// Its `Display` stands alone (the user may not see the input next to it):
/// `at byte 9 ("cores"): unknown processor unit type; expected one of numa, socket, ...`.
/// [`RequestError::render`] adds the input with a caret line under the offending text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct RequestError {
    /// Byte range of the offending text in the input (on character boundaries; empty only when
    /// the input itself is empty).
    pub span: Range<usize>,
    /// The offending text (`input[span]`).
    pub fragment: String,
    /// What is wrong.
    pub message: String,
    /// What is accepted at that point: keywords, values, or a description.
    pub expected: Vec<&'static str>,
}

/// Longest fragment quoted in full by `Display`.
const FRAGMENT_SHOWN: usize = 40;

impl RequestError {
    /// Builds an error for `span` of `text`, moving the span's ends out to character boundaries
    /// and inside the text.
    pub(crate) fn new(
        text: &str,
        span: Range<usize>,
        message: impl Into<String>,
        expected: &[&'static str],
    ) -> Self {
        let span = snap(text, span);
        let fragment = text.get(span.clone()).unwrap_or_default().to_string();
        Self { span, fragment, message: message.into(), expected: expected.to_vec() }
    }

    fn describe(&self) -> String {
        let mut out = format!("at byte {}", self.span.start);
        if !self.fragment.is_empty() {
            let shown: String = self.fragment.chars().take(FRAGMENT_SHOWN).collect();
            let more = if shown.len() < self.fragment.len() { "..." } else { "" };
            out.push_str(&format!(" ({shown:?}{more})"));
        }
        out.push_str(": ");
        out.push_str(&self.message);
        match self.expected.as_slice() {
            [] => {}
            [one] => out.push_str(&format!("; expected {one}")),
            many => out.push_str(&format!("; expected one of {}", many.join(", "))),
        }
        out
    }

    /// The input on one line, a caret line under the offending text, and the message: for a
    /// terminal, a batch system's error output or a pending reason.
    ///
    /// ```text
    /// affinity[cores(2)]
    ///          ^^^^^
    /// at byte 9 ("cores"): unknown processor unit type; expected one of numa, ...
    /// ```
    ///
    /// A long input is not quoted whole: at most [`QUOTED_CHARS`] characters around the error,
    /// with `...` where it was cut (a 10 KB request would otherwise fill a batch system's error
    /// output before the reason; qsub's holds about 3 KB).
    pub fn render(&self, input: &str) -> String {
        format!("{}\n{self}", caret(input, self.span.clone()))
    }
}

/// `input` on one line (control characters and the marks that reorder text as spaces; at most
/// [`QUOTED_CHARS`] characters around `span`, `...` where it was cut) and a caret line under
/// `span`'s text, by terminal columns (a wide character such as `［` takes two): what
/// [`RequestError::render`] shows, and what a client shows for a position topod sent
/// (`proto::ErrorAt`). A span outside the input or inside a character is moved to fit.
pub fn caret(input: &str, span: Range<usize>) -> String {
    use unicode_width::UnicodeWidthChar;
    let span = snap(input, span);
    let chars: Vec<char> =
        input.chars().map(|c| if c.is_control() || reorders(c) { ' ' } else { c }).collect();
    let start = input.get(..span.start).map_or(0, |s| s.chars().count());
    let len = input.get(span).map_or(0, |s| s.chars().count());
    let (from, to) = quoted_window(chars.len(), start);
    let cut_before = if from > 0 { "..." } else { "" };
    let cut_after = if to < chars.len() { "..." } else { "" };
    let line: String = chars[from..to].iter().collect();
    let columns = |cs: &[char]| cs.iter().map(|c| c.width().unwrap_or(0)).sum::<usize>();
    let caret_at = cut_before.len() + columns(&chars[from..start.clamp(from, to)]);
    let carets = columns(&chars[start.min(to)..(start + len).min(to)]).max(1);
    format!("{cut_before}{line}{cut_after}\n{}{}", " ".repeat(caret_at), "^".repeat(carets))
}

/// The bidirectional marks and overrides, which would reorder the quoted line on a terminal
/// away from its caret line.
fn reorders(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// How much of a request an error quotes: at most this many characters of it.
pub const QUOTED_CHARS: usize = 200;

/// The characters `from..to` of an input of `len` characters to quote for an error that starts
/// at character `start`: all of it when it is short, else a window of [`QUOTED_CHARS`] that
/// starts a little before the error, so that the caret has context and as much of the offending
/// text as fits is shown.
fn quoted_window(len: usize, start: usize) -> (usize, usize) {
    /// Characters kept before the error, when there are that many.
    const LEAD: usize = 60;
    if len <= QUOTED_CHARS {
        return (0, len);
    }
    // A full window that ends at the input's end when the error is near it.
    let from = start.min(len).saturating_sub(LEAD).min(len - QUOTED_CHARS);
    (from, from + QUOTED_CHARS)
}

/// Clamps `span` into `text` and widens it to character boundaries.
fn snap(text: &str, span: Range<usize>) -> Range<usize> {
    let mut start = span.start.min(text.len());
    let mut end = span.end.clamp(start, text.len());
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    while !text.is_char_boundary(end) {
        end += 1;
    }
    start..end
}

/// Parses a request: one `CPUSET[...]` and/or one `affinity[...]` section.
///
/// # Grammar
///
/// A request is one `CPUSET[...]` section and/or one `affinity[...]` section, in either order,
/// separated by white space. Section names are matched case-insensitively (`cpuset[`,
/// `AFFINITY[` are accepted); [`Request`]'s `Display` prints `CPUSET[` and `affinity[`.
///
/// ```text
/// request      = ws section [ ws section ] ws            (at most one of each kind)
/// section      = "CPUSET" ws "[" cpuset_body "]"
///              | "affinity" ws "[" affinity_body "]"
///
/// cpuset_body  = item { ";" item } [ ";" ]               (white space around keys and values ok)
/// item         = KEY "=" value
///   CPUSET_TYPE      = static | dynamic | none
///   CPUSET_NAME      = name              (1-64 of A-Z a-z 0-9 _ - . ; not starting with . or -,
///                                         no "..")
///   CPU_LIST         = 1,5,7-12          (spaces after commas ok: LSF prints "1, 5, 7-12")
///   CPUSET_OPTIONS   = opt { sep opt }   (sep: white space and/or "|")
///       opt ∈ CPUSET_CPU_EXCLUSIVE CPUSET_MEMORY_LOCAL CPUSET_MEMORY_EXCLUSIVE
///             CPUSET_MEMORY_KERNEL_AVOID CPUSET_MEMORY_MANDATORY CPUSET_POLICY_PAGE
///             CPUSET_POLICY_KILL CPUSET_EVENT_NOTIFY
///   MAX_RADIUS       = n                 (0 ..= 65536)
///   MAX_CPU_PER_NODE = n                 (1 ..= 65536)
///   RESUME_OPTION    = ORIG_CPUS
///
/// affinity_body = unit_spec { ":" clause }               (each clause at most once, any order)
/// unit_spec    = pu_type [ "(" count { "," pu_option } ")" ] [ "*" count [ "-" count ] ]   ("-": topo extension)
/// pu_type      = numa | socket | core | thread | mcm (= numa) | cpu (= thread) | l3
/// pu_option    = "same" "=" level
///              | "exclusive" "=" "(" level [ "," scope ] ")"   (each option at most once)
/// scope        = injob | alljobs | intask                     (default when omitted: intask)
/// clause       = "cpubind" "=" level
///              | "membind" "=" ( localonly | localprefer )
///              | "distribute" "=" ( "pack" [ "(" level "=" count ")" ] | balance | any )
///              | "mem" "=" size                                 (topo extension)
///              | "gpubind" "=" ( numa | socket | any )          (topo extension)
///              | "gpus" "=" count                               (topo extension)
/// level        = pu_type
/// count        = 1 ..= 65536
/// size         = digits [ K | M | G | T ] [ B ]                 (binary units; no suffix: MiB)
/// ```
///
/// Keywords and keyword values are matched case-insensitively everywhere (LSF documents the
/// `CPUSET` keywords in upper case and the affinity keywords in lower case; both spellings of
/// either are accepted). Only `CPUSET_NAME`'s value keeps its case. White space is allowed
/// between any two tokens of the affinity section (IBM's examples write
/// `core(2, same=socket, exclusive=(socket, injob))`) and around keys and values in `CPUSET`.
///
/// # Meaning
///
/// - `*count` is the number of tasks ([`Request::tasks`]); without it the batch system's slot
///   count decides (`bsub -n`). `(n)` is the number of units *per task*
///   ([`Request::units_per_task`]): `core(2)*4` is four tasks of two cores each.
/// - `same=level`: each task's units lie in one domain of `level`, which must be at least as
///   large as the unit, in the nominal order `thread < core < l3 < numa < socket`.
/// - `exclusive=(level[,scope])`: `level` must be at least the unit. The scope defaults to
///   `intask`, the narrowest one (as IBM's documentation for LSF 10.1 describes the default,
///   from memory: the full page could not be re-read when this was written). Canonical printing
///   always writes the scope, so no reader depends on the default.
/// - `pack(level=n)`: the docs' `pack(socket=1)`, i.e. the level's name is the key: the whole
///   job inside `n` domains of that level. `n >= 1`.
///
/// # topo extensions
///
/// - `l3` is a processor unit type and level (an L3 cache group, a CCX on AMD). No `cache`
///   alias: "cache" does not say which cache level.
/// - `:mem=SIZE` is a clause of the affinity section (not a unit option, because it is memory
///   for the whole job, not per unit): [`Request::mem_mib`]. Units are binary and
///   case-insensitive: `K` (rounded up to whole MiB), `M`, `G`, `T`, optionally followed by
///   `B`; a bare number is MiB. `1 MiB ..= 2^40 MiB`. Printed as `T`, `G` or `M`, whichever is
///   exact and largest.
/// - `:gpubind=` (jobs the batch system gave GPUs, passed to topod with the allocation):
///   `numa` puts every CPU of the job in a NUMA node one of its GPUs hangs off, `socket` in a
///   package one of them is in, or the job does not fit; `any` ignores where the GPUs are.
///   Without the clause the job's CPUs go in its GPUs' NUMA nodes when they fit there, and
///   anywhere the batch system allows when they do not ([`Request::gpubind`]).
/// - `:gpus=n` (where no batch system says which GPUs a job has: topod alone, LSF with topo's
///   module): `n` GPUs per task, which topod chooses with the CPUs beside them (GPUs under
///   one PCIe switch, CPUs in their NUMA node, or the job waits; [`Request::gpus_per_task`]).
///   Where the batch system did give the job GPUs, their number must be `n` per task.
/// - `*min-max` (malleable jobs): the job runs with at least `min` and at most `max` tasks, and
///   topod may grow or shrink it within that range while it runs ([`Request::tasks_max`]).
///   `max` must not be below `min`; `*4-4` is the rigid `*4`.
/// - `CPUSET_OPTIONS` also accepts `|` between options (LSF's docs only show one option, and
///   the reference leaves the separator unverified; white space is what SGI's tools used).
///
/// # Errors
///
/// Nothing unrecognized is skipped: every error is a [`RequestError`] with the byte span of the
/// offending text in the input, that text, a message and the accepted keywords or values at
/// that point. An empty `KEY=` value is an error here; it is accepted only by
/// [`merge_extsched`](super::merge_extsched), where it cancels a lower-priority setting.
pub fn parse(text: &str) -> Result<Request, RequestError> {
    parse_parts(text, false).map(|parts| parts.req)
}

impl FromStr for Request {
    type Err = RequestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
    }
}

/// The `CPUSET` keywords, in canonical printing order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CpusetKey {
    CpusetType,
    CpusetName,
    CpuList,
    CpusetOptions,
    MaxRadius,
    MaxCpuPerNode,
    ResumeOption,
}

/// The keyword names, indexed by `CpusetKey as usize`.
pub(crate) const KEY_NAMES: &[&str] = &[
    "CPUSET_TYPE",
    "CPUSET_NAME",
    "CPU_LIST",
    "CPUSET_OPTIONS",
    "MAX_RADIUS",
    "MAX_CPU_PER_NODE",
    "RESUME_OPTION",
];

impl CpusetKey {
    /// Every keyword, in canonical order.
    pub(crate) const ALL: [CpusetKey; 7] = [
        CpusetKey::CpusetType,
        CpusetKey::CpusetName,
        CpusetKey::CpuList,
        CpusetKey::CpusetOptions,
        CpusetKey::MaxRadius,
        CpusetKey::MaxCpuPerNode,
        CpusetKey::ResumeOption,
    ];

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(name))
    }

    /// The keyword as LSF spells it.
    pub(crate) fn name(self) -> &'static str {
        KEY_NAMES[self as usize]
    }

    /// Copies this keyword's setting from `from` into `to`.
    pub(crate) fn copy(self, from: &Request, to: &mut Request) {
        match self {
            CpusetKey::CpusetType => to.cpuset_type = from.cpuset_type,
            CpusetKey::CpusetName => to.cpuset_name.clone_from(&from.cpuset_name),
            CpusetKey::CpuList => to.cpu_list.clone_from(&from.cpu_list),
            CpusetKey::CpusetOptions => to.cpuset_options.clone_from(&from.cpuset_options),
            CpusetKey::MaxRadius => to.max_radius = from.max_radius,
            CpusetKey::MaxCpuPerNode => to.max_cpu_per_node = from.max_cpu_per_node,
            CpusetKey::ResumeOption => to.resume_option = from.resume_option,
        }
    }

    fn expected_values(self) -> &'static [&'static str] {
        match self {
            CpusetKey::CpusetType => &["static", "dynamic", "none"],
            CpusetKey::CpusetName => &["a name of letters, digits, '_', '-' and '.'"],
            CpusetKey::CpuList => &["a CPU list such as 1,5,7-12"],
            CpusetKey::CpusetOptions => &[
                "CPUSET_CPU_EXCLUSIVE",
                "CPUSET_MEMORY_LOCAL",
                "CPUSET_MEMORY_EXCLUSIVE",
                "CPUSET_MEMORY_KERNEL_AVOID",
                "CPUSET_MEMORY_MANDATORY",
                "CPUSET_POLICY_PAGE",
                "CPUSET_POLICY_KILL",
                "CPUSET_EVENT_NOTIFY",
            ],
            CpusetKey::MaxRadius | CpusetKey::MaxCpuPerNode => NUMBER,
            CpusetKey::ResumeOption => &["ORIG_CPUS"],
        }
    }
}

/// How one string mentions a `CPUSET` keyword.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Mention {
    /// Not at all.
    #[default]
    Absent,
    /// With a value (now in [`Parts::req`]).
    Set,
    /// With an empty value: cancels a lower-priority setting when merging.
    Cleared,
}

/// A parsed string, before merging: the request plus which keywords and sections it named.
#[derive(Debug, Clone, Default)]
pub(crate) struct Parts {
    /// Everything the string set.
    pub(crate) req: Request,
    /// Per `CpusetKey as usize`.
    pub(crate) mentioned: [Mention; 7],
    /// Whether the string had an `affinity[...]` section.
    pub(crate) has_affinity: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SectionKind {
    Cpuset,
    Affinity,
}

/// Parses `text` into its parts. `allow_empty_values`: whether `KEY=` (an empty value) is
/// accepted, as it is in the queue merge.
pub(crate) fn parse_parts(text: &str, allow_empty_values: bool) -> Result<Parts, RequestError> {
    if text.trim().is_empty() {
        return Err(RequestError::new(text, 0..text.len(), "empty request", SECTIONS));
    }
    let mut parts = Parts::default();
    let mut seen_cpuset = false;
    let mut pos = skip_ws(text, 0);
    while pos < text.len() {
        let name_end = word_end(text, pos);
        if name_end == pos {
            let msg = "unexpected character where a section should start";
            return Err(RequestError::new(text, char_span(text, pos), msg, SECTIONS));
        }
        let name = &text[pos..name_end];
        let kind = if name.eq_ignore_ascii_case("CPUSET") {
            SectionKind::Cpuset
        } else if name.eq_ignore_ascii_case("affinity") {
            SectionKind::Affinity
        } else {
            return Err(RequestError::new(text, pos..name_end, "unknown section", SECTIONS));
        };
        let already = match kind {
            SectionKind::Cpuset => std::mem::replace(&mut seen_cpuset, true),
            SectionKind::Affinity => std::mem::replace(&mut parts.has_affinity, true),
        };
        if already {
            let msg = format!("a second {name} section (at most one of each is allowed)");
            return Err(RequestError::new(text, pos..name_end, msg, &[]));
        }
        let open = skip_ws(text, name_end);
        if !text[open..].starts_with('[') {
            let msg = format!("'[' must follow the section name {name}");
            return Err(RequestError::new(text, char_span(text, open), msg, &["["]));
        }
        let Some(close) = text[open + 1..].find(']').map(|i| open + 1 + i) else {
            let msg = format!("this '[' of {name} is never closed");
            return Err(RequestError::new(text, open..open + 1, msg, &["]"]));
        };
        let body = open + 1..close;
        match kind {
            SectionKind::Cpuset => parse_cpuset(text, body, allow_empty_values, &mut parts)?,
            SectionKind::Affinity => Affinity::new(text, body).parse(&mut parts.req)?,
        }
        pos = skip_ws(text, close + 1);
    }
    Ok(parts)
}

fn skip_ws(text: &str, pos: usize) -> usize {
    text.get(pos..).map_or(text.len(), |rest| text.len() - rest.trim_start().len())
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn word_end(text: &str, pos: usize) -> usize {
    let rest = text.get(pos..).unwrap_or_default();
    pos + rest.find(|c: char| !is_word_char(c)).unwrap_or(rest.len())
}

/// The span of the character at `pos`, or an empty span at the end of the text.
fn char_span(text: &str, pos: usize) -> Range<usize> {
    let len = text.get(pos..).and_then(|s| s.chars().next()).map_or(0, char::len_utf8);
    pos..pos + len
}

/// `s` with surrounding white space removed, and the byte offset of what is left inside `s`.
fn trim_with_offset(s: &str) -> (&str, usize) {
    let start = s.len() - s.trim_start().len();
    (s.trim(), start)
}

// ---------------------------------------------------------------------------------------------
// CPUSET[...]

fn parse_cpuset(
    text: &str,
    body: Range<usize>,
    allow_empty_values: bool,
    parts: &mut Parts,
) -> Result<(), RequestError> {
    let content = &text[body.clone()];
    if content.trim().is_empty() && allow_empty_values {
        // In a queue merge an empty section is what deleting every keyword leaves (a string
        // mbatchd has merged already, `CPUSET[MAX_RADIUS=]` over `CPUSET[MAX_RADIUS=1]`): it
        // asks for nothing.
        return Ok(());
    }
    if content.trim().is_empty() {
        let span = body.start - 1..body.end + 1;
        return Err(RequestError::new(text, span, "empty CPUSET[] section", KEY_NAMES));
    }
    let items: Vec<&str> = content.split(';').collect();
    let mut start = body.start;
    for (i, item) in items.iter().enumerate() {
        let item_start = start;
        start += item.len() + 1;
        if item.trim().is_empty() {
            if i + 1 == items.len() {
                continue; // a trailing ';'
            }
            let span = item_start..(item_start + item.len() + 1).min(body.end);
            let msg = "empty item between ';' separators";
            return Err(RequestError::new(text, span, msg, KEY_NAMES));
        }
        parse_cpuset_item(text, item_start, item, allow_empty_values, parts)?;
    }
    Ok(())
}

fn parse_cpuset_item(
    text: &str,
    item_start: usize,
    item: &str,
    allow_empty_values: bool,
    parts: &mut Parts,
) -> Result<(), RequestError> {
    let (trimmed, lead) = trim_with_offset(item);
    let Some(eq) = item.find('=') else {
        let span = item_start + lead..item_start + lead + trimmed.len();
        let msg = "expected KEYWORD=value";
        return Err(RequestError::new(text, span, msg, KEY_NAMES));
    };
    let (key_text, key_lead) = trim_with_offset(&item[..eq]);
    let key_span = if key_text.is_empty() {
        item_start + eq..item_start + eq + 1
    } else {
        item_start + key_lead..item_start + key_lead + key_text.len()
    };
    let Some(key) = CpusetKey::from_name(key_text) else {
        return Err(RequestError::new(text, key_span, "unknown CPUSET keyword", KEY_NAMES));
    };
    let slot = &mut parts.mentioned[key as usize];
    if *slot != Mention::Absent {
        let msg = format!("{} given twice", key.name());
        return Err(RequestError::new(text, key_span, msg, &[]));
    }
    let (value, value_lead) = trim_with_offset(&item[eq + 1..]);
    let value_start = item_start + eq + 1 + value_lead;
    if value.is_empty() {
        if allow_empty_values {
            *slot = Mention::Cleared;
            return Ok(());
        }
        let span = key_span.start..item_start + eq + 1;
        let msg = format!(
            "empty value for {} (an empty value only cancels a queue's setting when job and \
             queue strings are merged)",
            key.name()
        );
        return Err(RequestError::new(text, span, msg, key.expected_values()));
    }
    *slot = Mention::Set;
    let value_span = value_start..value_start + value.len();
    set_cpuset_value(text, key, value, value_span, &mut parts.req)
}

fn set_cpuset_value(
    text: &str,
    key: CpusetKey,
    value: &str,
    span: Range<usize>,
    req: &mut Request,
) -> Result<(), RequestError> {
    let bad = |msg: String| RequestError::new(text, span.clone(), msg, key.expected_values());
    match key {
        CpusetKey::CpusetType => {
            let found = lookup(TYPE_NAMES, value);
            req.cpuset_type = Some(found.ok_or_else(|| bad("unknown CPUSET_TYPE".into()))?);
        }
        CpusetKey::CpusetName => {
            check_name(value).map_err(|why| bad(format!("bad CPUSET_NAME: {why}")))?;
            req.cpuset_name = Some(value.to_string());
        }
        CpusetKey::CpuList => req.cpu_list = Some(parse_cpu_list(text, value, span.start)?),
        CpusetKey::CpusetOptions => req.cpuset_options = parse_options(text, value, span.start)?,
        CpusetKey::MaxRadius => req.max_radius = Some(parse_number(text, span, 0, "MAX_RADIUS")?),
        CpusetKey::MaxCpuPerNode => {
            req.max_cpu_per_node = Some(parse_number(text, span, 1, "MAX_CPU_PER_NODE")?);
        }
        CpusetKey::ResumeOption => {
            if !value.eq_ignore_ascii_case("ORIG_CPUS") {
                return Err(bad("unknown RESUME_OPTION".into()));
            }
            req.resume_option = Some(ResumeOption::OrigCpus);
        }
    }
    Ok(())
}

/// Checks a `CPUSET_NAME`: it names a cpuset directory, so no path tricks.
pub(crate) fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("longer than 64 characters");
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')) {
        return Err("only letters, digits, '_', '-' and '.' are allowed");
    }
    if name.starts_with(['.', '-']) {
        return Err("must not start with '.' or '-'");
    }
    if name.contains("..") {
        return Err("must not contain \"..\"");
    }
    Ok(())
}

fn parse_cpu_list(text: &str, value: &str, start: usize) -> Result<CpuSet, RequestError> {
    let expected = CpusetKey::CpuList.expected_values();
    match CpuSet::parse_list(value) {
        Ok(set) if set.is_empty() => {
            let span = start..start + value.len();
            Err(RequestError::new(text, span, "CPU_LIST names no CPU", expected))
        }
        Ok(set) => Ok(set),
        Err(e) => {
            let at = e.offset.min(value.len());
            let item_end =
                value.get(at..).and_then(|s| s.find(',')).map_or(value.len(), |i| at + i);
            let span = start + at..start + item_end.max(at + 1).min(value.len());
            let msg = format!("bad CPU_LIST: {}", e.reason);
            Err(RequestError::new(text, span, msg, expected))
        }
    }
}

fn parse_options(text: &str, value: &str, start: usize) -> Result<Vec<CpusetOption>, RequestError> {
    let expected = CpusetKey::CpusetOptions.expected_values();
    let mut out: Vec<CpusetOption> = Vec::new();
    let mut pos = 0;
    while pos < value.len() {
        let rest = &value[pos..];
        let skip =
            rest.len() - rest.trim_start_matches(|c: char| c.is_whitespace() || c == '|').len();
        pos += skip;
        let rest = &value[pos..];
        let len = rest.find(|c: char| c.is_whitespace() || c == '|').unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        let span = start + pos..start + pos + len;
        let Some(opt) = lookup(OPTION_NAMES, &rest[..len]) else {
            return Err(RequestError::new(text, span, "unknown CPUSET_OPTIONS option", expected));
        };
        if out.contains(&opt) {
            return Err(RequestError::new(text, span, "option given twice", &[]));
        }
        out.push(opt);
        pos += len;
    }
    if out.is_empty() {
        let span = start..start + value.len();
        return Err(RequestError::new(text, span, "CPUSET_OPTIONS names no option", expected));
    }
    out.sort();
    Ok(out)
}

/// Reads a decimal number in `min ..= MAX_COUNT` from `text[span]`.
fn parse_number(text: &str, span: Range<usize>, min: u32, what: &str) -> Result<u32, RequestError> {
    let digits = text.get(span.clone()).unwrap_or_default();
    let value = parse_digits(digits, u64::from(MAX_COUNT))
        .map_err(|why| RequestError::new(text, span.clone(), format!("{what}: {why}"), NUMBER))?;
    if value < u64::from(min) {
        let msg = format!("{what} must be at least {min}");
        return Err(RequestError::new(text, span, msg, NUMBER));
    }
    u32::try_from(value).map_err(|_| RequestError::new(text, span, "number too large", NUMBER))
}

/// Reads a non-empty run of ASCII digits no larger than `max`.
fn parse_digits(digits: &str, max: u64) -> Result<u64, String> {
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a whole number".into());
    }
    let mut value: u64 = 0;
    for b in digits.bytes() {
        value = value * 10 + u64::from(b - b'0');
        if value > max {
            return Err(format!("too large (at most {max})"));
        }
    }
    Ok(value)
}

fn lookup<T: Copy>(table: &[(&str, T)], word: &str) -> Option<T> {
    table.iter().find(|(name, _)| name.eq_ignore_ascii_case(word)).map(|&(_, v)| v)
}

// ---------------------------------------------------------------------------------------------
// affinity[...]

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    /// A run of ASCII letters, digits and `_`.
    Word,
    /// One of `( ) , = * :`.
    Punct(u8),
    /// Any other character.
    Other,
    /// The end of the section (its span is the closing `]`).
    End,
}

#[derive(Debug, Clone, Copy)]
struct Token {
    kind: Tok,
    start: usize,
    end: usize,
}

/// A tokenizer and recursive-descent parser over the body of one `affinity[...]` section.
struct Affinity<'a> {
    text: &'a str,
    pos: usize,
    end: usize,
    peeked: Option<Token>,
}

impl<'a> Affinity<'a> {
    fn new(text: &'a str, body: Range<usize>) -> Self {
        Self { text, pos: body.start, end: body.end, peeked: None }
    }

    fn lex(&mut self) -> Token {
        let rest = &self.text[self.pos..self.end];
        self.pos = self.end - rest.trim_start().len();
        let start = self.pos;
        let Some(c) = self.text[start..self.end].chars().next() else {
            return Token {
                kind: Tok::End,
                start: self.end,
                end: (self.end + 1).min(self.text.len()),
            };
        };
        let kind = if is_word_char(c) {
            self.pos = word_end(self.text, start).min(self.end);
            Tok::Word
        } else if matches!(c, '(' | ')' | ',' | '=' | '*' | ':' | '-') {
            self.pos += 1;
            Tok::Punct(c as u8)
        } else {
            self.pos += c.len_utf8();
            Tok::Other
        };
        Token { kind, start, end: self.pos }
    }

    fn next(&mut self) -> Token {
        match self.peeked.take() {
            Some(t) => t,
            None => self.lex(),
        }
    }

    fn peek(&mut self) -> Token {
        let t = self.next();
        self.peeked = Some(t);
        t
    }

    fn slice(&self, t: Token) -> &'a str {
        self.text.get(t.start..t.end).unwrap_or_default()
    }

    fn error(
        &self,
        t: Token,
        message: impl Into<String>,
        expected: &[&'static str],
    ) -> RequestError {
        RequestError::new(self.text, t.start..t.end, message, expected)
    }

    /// The message for an unexpected token, naming what it is.
    fn unexpected(&self, t: Token, wanted: &str) -> String {
        match t.kind {
            Tok::End => format!("the section ends where {wanted} should follow"),
            _ => format!("unexpected text where {wanted} should follow"),
        }
    }

    fn expect_punct(&mut self, p: u8, wanted: &'static str) -> Result<Token, RequestError> {
        let t = self.next();
        if t.kind == Tok::Punct(p) {
            return Ok(t);
        }
        Err(self.error(t, self.unexpected(t, &format!("'{wanted}'")), &[wanted]))
    }

    fn expect_word(
        &mut self,
        wanted: &str,
        expected: &[&'static str],
    ) -> Result<(Token, &'a str), RequestError> {
        let t = self.next();
        if t.kind == Tok::Word {
            return Ok((t, self.slice(t)));
        }
        Err(self.error(t, self.unexpected(t, wanted), expected))
    }

    fn parse(mut self, req: &mut Request) -> Result<(), RequestError> {
        self.unit_spec(req)?;
        let mut seen = [false; CLAUSES.len()];
        loop {
            let t = self.next();
            match t.kind {
                Tok::End => return Ok(()),
                Tok::Punct(b':') => self.clause(req, &mut seen)?,
                _ => {
                    let msg = "unexpected text after the processor unit: clauses start with ':'";
                    return Err(self.error(t, msg, &[":", "]"]));
                }
            }
        }
    }

    fn level(&mut self, what: &str, allowed_from: Level) -> Result<(Token, Level), RequestError> {
        let expected = level_names_from(allowed_from);
        let (t, word) = self.expect_word(what, &expected)?;
        let Some(level) = lookup(LEVEL_NAMES, word) else {
            return Err(self.error(t, format!("unknown {what}"), &expected));
        };
        if level < allowed_from {
            let msg = format!(
                "{} is smaller than the processor unit {}",
                level.name(),
                allowed_from.name()
            );
            return Err(self.error(t, msg, &expected));
        }
        Ok((t, level))
    }

    fn count(&mut self, what: &str) -> Result<u32, RequestError> {
        let (t, _) = self.expect_word(what, NUMBER)?;
        parse_number(self.text, t.start..t.end, 1, what)
    }

    fn unit_spec(&mut self, req: &mut Request) -> Result<(), RequestError> {
        let (_, unit) = self.level("processor unit type", Level::Thread)?;
        req.unit = unit;
        if self.peek().kind == Tok::Punct(b'(') {
            self.next();
            req.units_per_task = self.count("number of units per task")?;
            loop {
                let t = self.next();
                match t.kind {
                    Tok::Punct(b')') => break,
                    Tok::Punct(b',') => self.unit_option(req)?,
                    _ => return Err(self.error(t, self.unexpected(t, "',' or ')'"), &[",", ")"])),
                }
            }
        }
        if self.peek().kind == Tok::Punct(b'*') {
            self.next();
            let min = self.count("number of tasks")?;
            req.tasks = Some(min);
            if self.peek().kind == Tok::Punct(b'-') {
                self.next();
                let (t, _) = self.expect_word("the most tasks of a malleable job", NUMBER)?;
                let max = parse_number(self.text, t.start..t.end, 1, "most tasks")?;
                if max < min {
                    let msg = format!("a malleable job's range {min}-{max} ends below its start");
                    return Err(self.error(t, msg, &[]));
                }
                // `*4-4` is a rigid job of four tasks.
                req.tasks_max = (max > min).then_some(max);
            }
        }
        Ok(())
    }

    fn unit_option(&mut self, req: &mut Request) -> Result<(), RequestError> {
        let (t, word) = self.expect_word("a processor unit option", UNIT_OPTIONS)?;
        if word.eq_ignore_ascii_case("same") {
            if req.same.is_some() {
                return Err(self.error(t, "same= given twice", &[]));
            }
            self.expect_punct(b'=', "=")?;
            req.same = Some(self.level("level for same=", req.unit)?.1);
        } else if word.eq_ignore_ascii_case("exclusive") {
            if req.exclusive.is_some() {
                return Err(self.error(t, "exclusive= given twice", &[]));
            }
            self.expect_punct(b'=', "=")?;
            self.expect_punct(b'(', "(")?;
            let (_, level) = self.level("level for exclusive=", req.unit)?;
            let mut scope = Scope::InTask;
            let t = self.next();
            match t.kind {
                Tok::Punct(b')') => {}
                Tok::Punct(b',') => {
                    let names: Vec<&'static str> = SCOPE_NAMES.iter().map(|(n, _)| *n).collect();
                    let (t, word) = self.expect_word("an exclusive scope", &names)?;
                    scope = lookup(SCOPE_NAMES, word)
                        .ok_or_else(|| self.error(t, "unknown exclusive scope", &names))?;
                    self.expect_punct(b')', ")")?;
                }
                _ => return Err(self.error(t, self.unexpected(t, "',' or ')'"), &[",", ")"])),
            }
            req.exclusive = Some(Exclusive { level, scope });
        } else {
            return Err(self.error(t, "unknown processor unit option", UNIT_OPTIONS));
        }
        Ok(())
    }

    fn clause(
        &mut self,
        req: &mut Request,
        seen: &mut [bool; CLAUSES.len()],
    ) -> Result<(), RequestError> {
        let (t, word) = self.expect_word("a clause", CLAUSES)?;
        let Some(index) = CLAUSES.iter().position(|c| c.eq_ignore_ascii_case(word)) else {
            return Err(self.error(t, "unknown clause", CLAUSES));
        };
        if std::mem::replace(&mut seen[index], true) {
            return Err(self.error(t, format!("{} given twice", CLAUSES[index]), &[]));
        }
        self.expect_punct(b'=', "=")?;
        match index {
            0 => req.cpubind = Some(self.level("level for cpubind=", Level::Thread)?.1),
            1 => {
                let (t, word) = self.expect_word("a memory binding", MEMBINDS)?;
                req.membind = if word.eq_ignore_ascii_case("localonly") {
                    MemBind::LocalOnly
                } else if word.eq_ignore_ascii_case("localprefer") {
                    MemBind::LocalPrefer
                } else {
                    return Err(self.error(t, "unknown memory binding", MEMBINDS));
                };
            }
            2 => req.distribute = self.distribution()?,
            3 => req.mem_mib = Some(self.size()?),
            5 => {
                let n = self.count("number of GPUs per task")?;
                if let (Some(min), Some(max)) = (req.tasks, req.tasks_max) {
                    let msg = format!(
                        "gpus={n} with a task range (*{min}-{max}): a job's GPUs do not grow or shrink with it; give a task count"
                    );
                    return Err(self.error(t, msg, &[]));
                }
                req.gpus_per_task = Some(n);
            }
            _ => {
                let (t, word) = self.expect_word("a GPU binding", GPUBIND_NAMES)?;
                let Some(&(_, bind)) =
                    GPUBINDS.iter().find(|(name, _)| name.eq_ignore_ascii_case(word))
                else {
                    return Err(self.error(t, "unknown GPU binding", GPUBIND_NAMES));
                };
                req.gpubind = Some(bind);
            }
        }
        Ok(())
    }

    fn distribution(&mut self) -> Result<Distribute, RequestError> {
        let (t, word) = self.expect_word("a task distribution", DISTRIBUTIONS)?;
        if word.eq_ignore_ascii_case("balance") {
            return Ok(Distribute::Balance);
        }
        if word.eq_ignore_ascii_case("any") {
            return Ok(Distribute::Any);
        }
        if !word.eq_ignore_ascii_case("pack") {
            return Err(self.error(t, "unknown task distribution", DISTRIBUTIONS));
        }
        if self.peek().kind != Tok::Punct(b'(') {
            return Ok(Distribute::Pack(None));
        }
        self.next();
        let (_, level) = self.level("level for pack(level=n)", Level::Thread)?;
        self.expect_punct(b'=', "=")?;
        let n = self.count("number of domains for pack(level=n)")?;
        self.expect_punct(b')', ")")?;
        Ok(Distribute::Pack(Some((level, n))))
    }

    fn size(&mut self) -> Result<u64, RequestError> {
        let (t, word) = self.expect_word("a memory size", SIZE)?;
        parse_size(word).map_err(|why| self.error(t, format!("bad mem= size: {why}"), SIZE))
    }
}

/// The level names (with aliases) of `from` and larger levels.
fn level_names_from(from: Level) -> Vec<&'static str> {
    LEVEL_NAMES.iter().filter(|(_, l)| *l >= from).map(|(n, _)| *n).collect()
}

/// Reads `digits[K|M|G|T][B]` (binary units, case-insensitive, MiB when no unit) as MiB.
fn parse_size(word: &str) -> Result<u64, String> {
    let digits_end = word.find(|c: char| !c.is_ascii_digit()).unwrap_or(word.len());
    let (digits, unit) = word.split_at(digits_end);
    let unit = unit.to_ascii_uppercase();
    let unit = unit.strip_suffix('B').unwrap_or(&unit);
    let (shift, round_up_kib) = match unit {
        "" | "M" => (0, false),
        "K" => (0, true),
        "G" => (10, false),
        "T" => (20, false),
        _ => return Err(format!("unknown unit {unit:?}")),
    };
    let max_digits = if round_up_kib { MAX_MEM_MIB << 10 } else { MAX_MEM_MIB >> shift };
    let n = parse_digits(digits, max_digits).map_err(|e| {
        if e.starts_with("too large") {
            format!("larger than the largest accepted, {MAX_MEM_MIB} MiB")
        } else {
            e
        }
    })?;
    let mib = if round_up_kib { n.div_ceil(1024) } else { n << shift };
    if mib == 0 {
        return Err("must be at least 1 MiB".into());
    }
    Ok(mib)
}

impl Level {
    /// The canonical (lower-case) name: `thread`, `core`, `l3`, `numa`, `socket`.
    pub fn name(self) -> &'static str {
        match self {
            Level::Thread => "thread",
            Level::Core => "core",
            Level::L3 => "l3",
            Level::Numa => "numa",
            Level::Socket => "socket",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
