//! Tests of the request language: documented examples, errors with their spans, the queue
//! merge, canonical printing, and robustness (proptest, and a long seeded fuzz loop).

use super::parse::check_name;
use super::*;
use proptest::prelude::*;

fn p(text: &str) -> Request {
    match parse(text) {
        Ok(r) => r,
        Err(e) => panic!("{text:?} did not parse:\n{}", e.render(text)),
    }
}

fn e(text: &str) -> RequestError {
    match parse(text) {
        Ok(r) => panic!("{text:?} parsed to {r:?}"),
        Err(e) => e,
    }
}

/// Asserts that `text` fails with exactly `fragment` at byte `at`, and a message containing
/// `message`.
fn assert_err(text: &str, at: usize, fragment: &str, message: &str) {
    let err = e(text);
    assert_eq!(err.span, at..at + fragment.len(), "span of {text:?}: {err}");
    assert_eq!(err.fragment, fragment, "fragment of {text:?}: {err}");
    assert!(err.message.contains(message), "message of {text:?}: {err}");
    assert_eq!(&text[err.span.clone()], err.fragment);
}

fn roundtrip(r: &Request) {
    let text = r.to_string();
    assert_eq!(parse(&text).as_ref(), Ok(r), "canonical text {text:?}");
}

fn core_req() -> Request {
    Request { unit: Level::Core, ..Request::default() }
}

// ---------------------------------------------------------------------------------------------
// Documented examples

#[test]
fn ibm_affinity_examples() {
    let r = p("affinity[core(2,same=socket,exclusive=(socket,injob))]");
    let ex = |level, scope| Some(Exclusive { level, scope });
    assert_eq!(
        r,
        Request {
            units_per_task: 2,
            same: Some(Level::Socket),
            exclusive: ex(Level::Socket, Scope::InJob),
            ..core_req()
        }
    );
    assert_eq!(r.to_string(), "affinity[core(2,same=socket,exclusive=(socket,injob))]");

    let text = "affinity[core(2, same=socket, exclusive=(socket, alljobs)): cpubind=socket:distribute=balance]";
    let r = p(text);
    assert_eq!(
        r,
        Request {
            units_per_task: 2,
            same: Some(Level::Socket),
            exclusive: ex(Level::Socket, Scope::AllJobs),
            cpubind: Some(Level::Socket),
            distribute: Distribute::Balance,
            ..core_req()
        }
    );
    assert_eq!(
        r.to_string(),
        "affinity[core(2,same=socket,exclusive=(socket,alljobs)):cpubind=socket:distribute=balance]"
    );

    let text =
        "affinity[core(1,same=socket,exclusive=(socket,injob)):cpubind=socket:membind=localonly:distribute=pack]";
    let r = p(text);
    assert_eq!(
        r,
        Request {
            same: Some(Level::Socket),
            exclusive: ex(Level::Socket, Scope::InJob),
            cpubind: Some(Level::Socket),
            membind: MemBind::LocalOnly,
            distribute: Distribute::Pack(None),
            ..core_req()
        }
    );
    assert_eq!(r.to_string(), text);

    let text = "affinity[core(5,same=numa):cpubind=numa:membind=localonly]";
    let r = p(text);
    assert_eq!(
        r,
        Request {
            units_per_task: 5,
            same: Some(Level::Numa),
            cpubind: Some(Level::Numa),
            membind: MemBind::LocalOnly,
            ..core_req()
        }
    );
    assert_eq!(r.to_string(), text);

    let r = p("affinity[core:membind=localprefer]");
    assert_eq!(r, core_req());
    assert_eq!(r.to_string(), "affinity[core]");

    let r = p("affinity[core(1):distribute=pack(socket=1)]");
    assert_eq!(r, Request { distribute: Distribute::Pack(Some((Level::Socket, 1))), ..core_req() });
    assert_eq!(r.to_string(), "affinity[core:distribute=pack(socket=1)]");

    assert_eq!(p("affinity[core(5)]"), Request { units_per_task: 5, ..core_req() });

    // DESIGN.md's example.
    let r = p("affinity[core(2,same=numa)*4:membind=localonly]");
    assert_eq!(
        r,
        Request {
            tasks: Some(4),
            units_per_task: 2,
            same: Some(Level::Numa),
            membind: MemBind::LocalOnly,
            ..core_req()
        }
    );
    assert_eq!(r.to_string(), "affinity[core(2,same=numa)*4:membind=localonly]");
}

#[test]
fn ibm_cpuset_examples() {
    let r = p("CPUSET[MAX_CPU_PER_NODE=4;CPU_LIST=1,5,7-12;]");
    let list = CpuSet::parse_list("1,5,7-12").ok();
    assert_eq!(
        r,
        Request { max_cpu_per_node: Some(4), cpu_list: list.clone(), ..Request::default() }
    );
    assert_eq!(r.to_string(), "CPUSET[CPU_LIST=1,5,7-12;MAX_CPU_PER_NODE=4]");

    let r = p("CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]");
    assert_eq!(
        r,
        Request { cpuset_options: vec![CpusetOption::CpuExclusive], ..Request::default() }
    );
    assert_eq!(r.to_string(), "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]");

    let text = "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE;MAX_RADIUS=2]";
    let r = p(text);
    assert_eq!(
        r,
        Request {
            cpuset_options: vec![CpusetOption::CpuExclusive],
            max_radius: Some(2),
            ..Request::default()
        }
    );
    assert_eq!(r.to_string(), text);
    assert_eq!(r.exclusive_level(), Some(Level::Core));

    // As LSF prints the list back: spaces after the commas.
    assert_eq!(p("CPUSET[CPU_LIST=1, 5, 7-12]").cpu_list, list);
}

#[test]
fn every_cpuset_keyword() {
    let text = "cpuset[ cpuset_type = Static ; CPUSET_NAME=Batch-1.a ; CPU_LIST = 0-3, 8 ; \
                CPUSET_OPTIONS=CPUSET_MEMORY_MANDATORY | cpuset_cpu_exclusive  CPUSET_EVENT_NOTIFY; \
                MAX_RADIUS=0; MAX_CPU_PER_NODE=16; RESUME_OPTION=orig_cpus ]";
    let r = p(text);
    assert_eq!(
        r,
        Request {
            cpuset_type: Some(CpusetType::Static),
            cpuset_name: Some("Batch-1.a".into()),
            cpu_list: CpuSet::parse_list("0-3,8").ok(),
            cpuset_options: vec![
                CpusetOption::CpuExclusive,
                CpusetOption::MemoryMandatory,
                CpusetOption::EventNotify
            ],
            max_radius: Some(0),
            max_cpu_per_node: Some(16),
            resume_option: Some(ResumeOption::OrigCpus),
            ..Request::default()
        }
    );
    assert_eq!(
        r.to_string(),
        "CPUSET[CPUSET_TYPE=static;CPUSET_NAME=Batch-1.a;CPU_LIST=0-3,8;\
         CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE CPUSET_MEMORY_MANDATORY CPUSET_EVENT_NOTIFY;\
         MAX_RADIUS=0;MAX_CPU_PER_NODE=16;RESUME_OPTION=ORIG_CPUS]"
    );
    for t in ["dynamic", "DYNAMIC", "none"] {
        assert!(p(&format!("CPUSET[CPUSET_TYPE={t}]")).cpuset_type.is_some());
    }
}

#[test]
fn affinity_forms_aliases_and_extensions() {
    assert_eq!(p("affinity[thread]"), Request::default());
    assert_eq!(p("affinity[cpu]"), Request::default());
    assert_eq!(p("affinity[mcm]").unit, Level::Numa);
    assert_eq!(
        p("AFFINITY[ L3 ( 2 ) * 3 ]"),
        Request { unit: Level::L3, units_per_task: 2, tasks: Some(3), ..Request::default() }
    );
    assert_eq!(p("affinity[core*4]"), Request { tasks: Some(4), ..core_req() });
    assert_eq!(p("affinity[core(2)*4]").tasks, Some(4));
    // Malleable jobs (topo extension): a task range; a range of one is rigid.
    let r = p("affinity[core(2,same=numa) * 4 - 16:membind=localonly]");
    assert_eq!((r.tasks, r.tasks_max, r.task_range()), (Some(4), Some(16), (4, 16)));
    assert!(r.is_malleable());
    assert_eq!(r.to_string(), "affinity[core(2,same=numa)*4-16:membind=localonly]");
    assert_eq!(p("affinity[thread*4-4]"), p("affinity[thread*4]"));
    assert_eq!(p("affinity[thread*4]").task_range(), (4, 4));
    for (bad, says) in [
        ("affinity[thread*8-4]", "ends below its start"),
        ("affinity[thread*4-]", "most tasks of a malleable job"),
        ("affinity[thread*4-x]", "most tasks"),
        ("affinity[thread*4-99999999]", "too large"),
        ("affinity[thread-4]", "clauses start with ':'"),
    ] {
        let e = parse(bad).expect_err(bad).to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    // exclusive without same, default scope, either option order.
    let r = p("affinity[core(2,exclusive=(numa))]");
    assert_eq!(r.exclusive, Some(Exclusive { level: Level::Numa, scope: Scope::InTask }));
    assert_eq!(r.to_string(), "affinity[core(2,exclusive=(numa,intask))]");
    let r = p("affinity[thread(2,exclusive=(core,injob),same=core)]");
    assert_eq!(r.same, Some(Level::Core));
    assert_eq!(r.to_string(), "affinity[thread(2,same=core,exclusive=(core,injob))]");
    // same level equal to the unit is fine.
    assert_eq!(p("affinity[core(2,same=core)]").same, Some(Level::Core));
    // clauses in any order.
    let a = p("affinity[core:distribute=any:membind=localonly:cpubind=core]");
    let b = p("affinity[core:cpubind=core:membind=localonly]");
    assert_eq!(a, b);
    assert_eq!(
        p("affinity[core:distribute=pack(mcm=2)]").distribute,
        Distribute::Pack(Some((Level::Numa, 2)))
    );
    // mem= extension.
    assert_eq!(p("affinity[core:mem=4G]").mem_mib, Some(4096));
    assert_eq!(p("affinity[core:mem=4gb]").mem_mib, Some(4096));
    assert_eq!(p("affinity[core:mem=100]").mem_mib, Some(100));
    assert_eq!(p("affinity[core:mem=1536M]").to_string(), "affinity[core:mem=1536M]");
    assert_eq!(p("affinity[core:mem=1025K]").mem_mib, Some(2));
    assert_eq!(p("affinity[core:mem=2T]").to_string(), "affinity[core:mem=2T]");
    assert_eq!(p("affinity[core:mem=2048M]").to_string(), "affinity[core:mem=2G]");
}

#[test]
fn gpubind_reads_prints_and_refuses_with_its_words() {
    assert_eq!(p("affinity[core*4:gpubind=numa]").gpubind, Some(GpuBind::Numa));
    assert_eq!(p("affinity[core:GPUBIND=Socket]").gpubind, Some(GpuBind::Socket));
    assert_eq!(p("affinity[core:gpubind=any]").gpubind, Some(GpuBind::Any));
    assert_eq!(p("affinity[core]").gpubind, None);
    assert_eq!(
        p("affinity[core(2)*4:gpubind=numa:mem=4G]").to_string(),
        "affinity[core(2)*4:mem=4G:gpubind=numa]"
    );
    let err = e("affinity[core:gpubind=pcie]");
    assert_eq!(err.span, 22..26);
    assert!(err.to_string().contains("unknown GPU binding; expected one of numa, socket, any"));
    let twice = e("affinity[core:gpubind=numa:gpubind=any]");
    assert_eq!(twice.span, 27..34);
    assert!(twice.to_string().contains("gpubind given twice"), "{twice}");
}

#[test]
fn gpus_per_task_reads_prints_last_and_refuses_what_is_no_count() {
    assert_eq!(p("affinity[core*2:gpus=1]").gpus_per_task, Some(1));
    assert_eq!(p("affinity[core:GPUS = 4]").gpus_per_task, Some(4));
    assert_eq!(p("affinity[core]").gpus_per_task, None);
    assert_eq!(
        p("affinity[core(2)*4:gpus=2:gpubind=numa:mem=4G]").to_string(),
        "affinity[core(2)*4:mem=4G:gpubind=numa:gpus=2]"
    );
    for bad in ["affinity[core:gpus=0]", "affinity[core:gpus=two]", "affinity[core:gpus=65537]"] {
        let err = e(bad);
        assert!(err.to_string().contains("GPUs per task"), "{bad}: {err}");
    }
    let twice = e("affinity[core:gpus=1:gpus=2]");
    assert!(twice.to_string().contains("gpus given twice"), "{twice}");
    // GPUs do not resize with a malleable job: refused where it is written, not at the start.
    let text = "affinity[thread*1-2:mem=1G:gpus=1]";
    let ranged = e(text);
    assert_eq!(ranged.span.start, text.find("gpus").unwrap(), "{ranged}");
    assert!(ranged.to_string().contains("gpus=1 with a task range (*1-2)"), "{ranged}");
    assert_eq!(p("affinity[thread*2-2:gpus=1]").gpus_per_task, Some(1));
}

#[test]
fn both_sections_either_order() {
    let a = p("CPUSET[MAX_RADIUS=2] affinity[core(2)]");
    let b = p("  affinity[core(2)]\tCPUSET[MAX_RADIUS=2]  ");
    assert_eq!(a, b);
    assert_eq!(a.to_string(), "CPUSET[MAX_RADIUS=2] affinity[core(2)]");
    // An affinity section with only defaults is not printed next to a CPUSET section.
    assert_eq!(p("CPUSET[MAX_RADIUS=2] affinity[thread]").to_string(), "CPUSET[MAX_RADIUS=2]");
    assert_eq!("affinity[numa]".parse::<Request>().map(|r| r.unit), Ok(Level::Numa));
}

#[test]
fn canonical_default_request() {
    assert_eq!(Request::default().to_string(), "affinity[thread]");
    assert_eq!(Request::threads(8).to_string(), "affinity[thread*8]");
    roundtrip(&Request::default());
    roundtrip(&Request::threads(8));
}

// ---------------------------------------------------------------------------------------------
// Errors

#[test]
fn error_display_and_render() {
    let text = "affinity[cores(2)]";
    let err = e(text);
    assert_eq!(
        err.to_string(),
        "at byte 9 (\"cores\"): unknown processor unit type; expected one of numa, socket, core, \
         thread, mcm, cpu, l3"
    );
    assert_eq!(err.span, 9..14);
    let rendered = err.render(text);
    let lines: Vec<&str> = rendered.lines().collect();
    assert_eq!(lines[0], text);
    assert_eq!(lines[1], "         ^^^^^");
    assert_eq!(lines[2], err.to_string());
    // A caret under the end for an empty input, and no panic on a foreign input.
    assert!(e("").render("").contains('^'));
    assert!(err.render("").contains('^'));
    assert!(err.render("€€€€").contains('^'));
}

#[test]
fn the_caret_stands_under_the_error_on_a_terminal_whatever_the_characters_before_it() {
    use unicode_width::UnicodeWidthStr;
    // Found by attacking the client's caret: wide characters (a request pasted with full-width
    // brackets) took one caret column for two screen columns, and a right-to-left override
    // reordered the quoted line away from its caret line.
    for text in [
        "affinity[core(2)*4:membind=ｆoo]",
        "affinity[core(2)*4:mem\u{200b}bind=foo]",
        "affinity[core(2)\u{202e}*4:membind=foo]",
        "affinity[core(2)*4:membind=\u{4e2d}\u{6587}]",
    ] {
        let err = e(text);
        let rendered = err.render(text);
        let lines: Vec<&str> = rendered.lines().collect();
        assert!(!lines[0].contains('\u{202e}'), "{rendered}");
        let column = lines[1].find('^').expect("a caret");
        let before = &text[..err.span.start];
        let shown_before: String =
            before.chars().map(|c| if c == '\u{202e}' { ' ' } else { c }).collect();
        assert_eq!(column, shown_before.width(), "{text:?}: {rendered}");
        // As many carets as the offending text takes columns.
        let carets = lines[1].trim_start().len();
        assert_eq!(carets, err.fragment.width().max(1), "{text:?}: {rendered}");
    }
    // Under a wide character: two carets.
    let err = e("affinity［core]");
    let rendered = err.render("affinity［core]");
    assert_eq!(rendered.lines().nth(1), Some("        ^^"), "{rendered}");
}

#[test]
fn a_long_request_is_quoted_only_around_its_error() {
    // 10 KB of valid CPU list with a bad word in the middle, at the start and at the end.
    let list: String = (0..2000).map(|i| format!("{i},")).collect();
    for (text, bad) in [
        (format!("CPUSET[CPU_LIST={list}x]"), "x"),
        (format!("CPUSET[CPU_LIST={list}0;BOGUS=1]"), "BOGUS"),
        (format!("CPUSET[BOGUS=1;CPU_LIST={list}0]"), "BOGUS"),
    ] {
        let err = e(&text);
        let rendered = err.render(&text);
        let lines: Vec<&str> = rendered.lines().collect();
        assert_eq!(lines.len(), 3, "{rendered}");
        assert!(lines[0].chars().count() <= QUOTED_CHARS + 6, "quoted {} chars", lines[0].len());
        assert!(lines[0].starts_with("...") || lines[0].starts_with("CPUSET["), "{}", lines[0]);
        // The carets stand under the offending text.
        let caret = lines[1].find('^').expect("a caret");
        assert_eq!(&lines[0][caret..caret + bad.len()], bad, "{rendered}");
        assert_eq!(
            lines[1].trim_start().len(),
            err.fragment.len().clamp(1, QUOTED_CHARS),
            "{rendered}"
        );
        assert!(rendered.len() < 600, "{} bytes", rendered.len());
    }
    // A short request is still quoted whole.
    let text = "affinity[cores(2)]";
    assert_eq!(e(text).render(text).lines().next(), Some(text));
}

#[test]
fn errors_top_level() {
    let err = e("");
    assert_eq!((err.span.clone(), err.message.as_str()), (0..0, "empty request"));
    assert_eq!(err.to_string(), "at byte 0: empty request; expected one of CPUSET[, affinity[");
    assert_err("   ", 0, "   ", "empty request");
    assert_err("rusage[mem=100]", 0, "rusage", "unknown section");
    assert_err("affinity[core] affinity[numa]", 15, "affinity", "second affinity section");
    assert_err("CPUSET[MAX_RADIUS=1] cpuset[MAX_RADIUS=2]", 21, "cpuset", "second cpuset section");
    assert_err("affinity[core", 8, "[", "never closed");
    assert_err("affinity core", 9, "c", "'[' must follow");
    assert_err("affinity", 8, "", "'[' must follow");
    assert_err("affinity[core]]", 14, "]", "unexpected character");
    assert_err("affinity[core];CPUSET[MAX_RADIUS=1]", 14, ";", "unexpected character");
    assert_err("€affinity[core]", 0, "€", "unexpected character");
}

#[test]
fn errors_cpuset() {
    assert_err("CPUSET[]", 6, "[]", "empty CPUSET[] section");
    assert_err("CPUSET[MAX_RADIUS=2;MAX_RADIUS=3]", 20, "MAX_RADIUS", "MAX_RADIUS given twice");
    assert_err("CPUSET[max_radius=2;MAX_RADIUS=3]", 20, "MAX_RADIUS", "given twice");
    assert_err("CPUSET[MAX_RADIUS=]", 7, "MAX_RADIUS=", "empty value for MAX_RADIUS");
    assert_err("CPUSET[CPU_LIST= ;MAX_RADIUS=1]", 7, "CPU_LIST=", "empty value for CPU_LIST");
    assert_err("CPUSET[FOO=1]", 7, "FOO", "unknown CPUSET keyword");
    assert_err("CPUSET[=1]", 7, "=", "unknown CPUSET keyword");
    assert_err("CPUSET[ MAX_RADIUS ]", 8, "MAX_RADIUS", "expected KEYWORD=value");
    assert_err("CPUSET[;MAX_RADIUS=1]", 7, ";", "empty item");
    assert_err("CPUSET[MAX_RADIUS=1;;]", 20, ";", "empty item");
    assert_err("CPUSET[CPU_LIST=1,x,3]", 18, "x", "bad CPU_LIST");
    assert_err("CPUSET[CPU_LIST=1, 5, 12-7]", 22, "12-7", "runs backwards");
    assert_err("CPUSET[CPU_LIST=99999999]", 16, "99999999", "bad CPU_LIST");
    assert_err("CPUSET[CPUSET_TYPE=elastic]", 19, "elastic", "unknown CPUSET_TYPE");
    assert_err("CPUSET[CPUSET_NAME=../etc]", 19, "../etc", "bad CPUSET_NAME");
    assert_err("CPUSET[CPUSET_NAME=a/b]", 19, "a/b", "bad CPUSET_NAME");
    let long = format!("CPUSET[CPUSET_NAME={}]", "a".repeat(65));
    assert_err(&long, 19, &"a".repeat(65), "longer than 64");
    assert_err(
        "CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE|NODE_EXCLUSIVE]",
        43,
        "NODE_EXCLUSIVE",
        "unknown CPUSET_OPTIONS option",
    );
    assert_err(
        "CPUSET[CPUSET_OPTIONS=CPUSET_POLICY_KILL CPUSET_POLICY_KILL]",
        41,
        "CPUSET_POLICY_KILL",
        "given twice",
    );
    assert_err("CPUSET[CPUSET_OPTIONS=|]", 22, "|", "names no option");
    assert_err("CPUSET[MAX_RADIUS=-1]", 18, "-1", "not a whole number");
    assert_err("CPUSET[MAX_RADIUS=65537]", 18, "65537", "too large");
    assert_err("CPUSET[MAX_CPU_PER_NODE=0]", 24, "0", "at least 1");
    assert_err("CPUSET[RESUME_OPTION=NEW_CPUS]", 21, "NEW_CPUS", "unknown RESUME_OPTION");
    assert_eq!(e("CPUSET[CPUSET_TYPE=x]").expected, vec!["static", "dynamic", "none"]);
}

#[test]
fn errors_affinity() {
    assert_err("affinity[]", 9, "]", "the section ends where processor unit type should follow");
    assert_err(
        "affinity[core(2,same=thread)]",
        21,
        "thread",
        "thread is smaller than the processor unit core",
    );
    assert_eq!(
        e("affinity[core(2,same=thread)]").expected,
        vec!["numa", "socket", "core", "mcm", "l3"]
    );
    assert_err(
        "affinity[numa(1,exclusive=(core))]",
        27,
        "core",
        "smaller than the processor unit numa",
    );
    assert_err("affinity[core(0)]", 14, "0", "at least 1");
    assert_err(
        "affinity[core(99999999999999999999999)]",
        14,
        "99999999999999999999999",
        "too large",
    );
    assert_err("affinity[core*65537]", 14, "65537", "too large");
    assert_err("affinity[core()]", 14, ")", "number of units per task");
    assert_err("affinity[core*2(3)]", 15, "(", "clauses start with ':'");
    assert_err("affinity[core:cpubind=core:cpubind=numa]", 27, "cpubind", "cpubind given twice");
    assert_err("affinity[core:cpubnd=core]", 14, "cpubnd", "unknown clause");
    assert_err("affinity[core:membind=]", 22, "]", "memory binding");
    assert_err("affinity[core:membind=remote]", 22, "remote", "unknown memory binding");
    assert_err("affinity[core:distribute=pack(level=2)]", 30, "level", "unknown level for pack");
    assert_err("affinity[core:distribute=pack(socket=0)]", 37, "0", "at least 1");
    assert_err("affinity[core:distribute=pack(socket)]", 36, ")", "'='");
    assert_err("affinity[core:distribute=spread]", 25, "spread", "unknown task distribution");
    assert_err(
        "affinity[core(2,exclusive=(socket,sometimes))]",
        34,
        "sometimes",
        "unknown exclusive scope",
    );
    assert_err("affinity[core(2,exclusive=socket)]", 26, "socket", "'('");
    assert_err("affinity[core(2,same=core,same=core)]", 26, "same", "same= given twice");
    assert_err(
        "affinity[core(2,Same=socket,exclusive=(socket),EXCLUSIVE=(numa))]",
        47,
        "EXCLUSIVE",
        "exclusive= given twice",
    );
    assert_err("affinity[core(2,shared=yes)]", 16, "shared", "unknown processor unit option");
    assert_err("affinity[core(2 3)]", 16, "3", "',' or ')'");
    assert_err("affinity[core:mem=4X]", 18, "4X", "unknown unit");
    assert_err("affinity[core:mem=0]", 18, "0", "at least 1 MiB");
    assert_err(
        "affinity[core:mem=99999999999999999999T]",
        18,
        "99999999999999999999T",
        "larger than",
    );
    assert_err("affinity[core:mem=4.5G]", 19, ".", "clauses start with ':'");
    assert_err("affinity[cöre]", 9, "c", "unknown processor unit type");
    assert_err("affinity[core:cpubind=cöre]", 22, "c", "unknown level for cpubind=");
    assert_err("affinity[coreö]", 13, "ö", "clauses start with ':'");
    assert_err("affinity[core numa]", 14, "numa", "clauses start with ':'");
    assert_err("affinity[core(2,same=socket))]", 28, ")", "clauses start with ':'");
    assert_err("affinity[((((((((((]", 9, "(", "processor unit type");
}

// ---------------------------------------------------------------------------------------------
// Queue merge

#[test]
fn merge_worked_example() {
    let merged = merge_extsched(
        Some("CPUSET[CPUSET_TYPE=dynamic;MAX_CPU_PER_NODE=2]"),
        Some("CPUSET[CPU_LIST=1,5,7-12;MAX_CPU_PER_NODE=4]"),
        Some("CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]"),
    );
    let expected =
        p("CPUSET[CPUSET_TYPE=dynamic;MAX_CPU_PER_NODE=2;CPU_LIST=1, 5, 7-12;CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]");
    assert_eq!(merged, Ok(expected));
}

#[test]
fn a_section_emptied_by_a_merge_asks_for_nothing() {
    // What mbatchd may hand the module when it merged the queue's strings itself: every
    // keyword deleted. In a merge it means no CPUSET constraint; alone it is still refused.
    let merged = merge_extsched(None, Some("CPUSET[] affinity[core(1)]"), None);
    assert_eq!(merged, Ok(p("affinity[core(1)]")));
    assert!(merge_extsched(None, Some("CPUSET[]"), None).is_ok());
    assert!(parse("CPUSET[]").is_err());
}

#[test]
fn merge_empty_value_deletes() {
    // MANDATORY_EXTSCHED=CPUSET[MAX_RADIUS=] removes a user-set MAX_RADIUS.
    let merged = merge_extsched(
        Some("CPUSET[MAX_RADIUS=]"),
        Some("CPUSET[MAX_RADIUS=3;CPU_LIST=0-3]"),
        None,
    );
    assert_eq!(merged, Ok(p("CPUSET[CPU_LIST=0-3]")));
    // A job's empty value drops the queue default (LSF's SLURM[nodes=3;tmp=] example, in CPUSET).
    let merged = merge_extsched(
        None,
        Some("CPUSET[MAX_RADIUS=3;CPU_LIST=]"),
        Some("CPUSET[MAX_RADIUS=2;CPU_LIST=0-3]"),
    );
    assert_eq!(merged.map(|r| r.to_string()), Ok("CPUSET[MAX_RADIUS=3]".to_string()));
    // The mandatory string deletes even what the default sets.
    let merged = merge_extsched(
        Some("CPUSET[CPUSET_OPTIONS=]"),
        None,
        Some("CPUSET[CPUSET_OPTIONS=CPUSET_CPU_EXCLUSIVE]"),
    );
    assert_eq!(merged, Ok(Request::default()));
    // An empty value in the default string deletes nothing below it: a no-op.
    let merged =
        merge_extsched(None, Some("CPUSET[MAX_RADIUS=1]"), Some("CPUSET[MAX_RADIUS=;CPU_LIST=]"));
    assert_eq!(merged, Ok(p("CPUSET[MAX_RADIUS=1]")));
}

#[test]
fn merge_affinity_whole_and_precedence() {
    let merged = merge_extsched(
        None,
        Some("affinity[core(2)*4]"),
        Some("CPUSET[MAX_RADIUS=1] affinity[numa:membind=localonly:mem=1G]"),
    );
    assert_eq!(merged, Ok(p("CPUSET[MAX_RADIUS=1] affinity[core(2)*4]")));
    let merged = merge_extsched(Some("affinity[socket]"), Some("affinity[core(2)*4]"), None);
    assert_eq!(merged, Ok(p("affinity[socket]")));
    let merged = merge_extsched(
        Some("CPUSET[MAX_RADIUS=5]"),
        Some("CPUSET[MAX_RADIUS=3] affinity[core]"),
        None,
    );
    assert_eq!(merged, Ok(p("CPUSET[MAX_RADIUS=5] affinity[core]")));
    assert_eq!(merge_extsched(None, None, None), Ok(Request::default()));
    assert_eq!(merge_extsched(Some(""), Some("  "), None), Ok(Request::default()));
}

#[test]
fn merge_errors_name_the_string() {
    let err =
        merge_extsched(Some("CPUSET[MAX_RADIUS=1]"), Some("affinity[core]"), Some("CPUSET[BAD=1]"));
    let err = err.expect_err("bad default");
    assert_eq!(err.source_string, ExtschedSource::QueueDefault);
    assert_eq!(err.error.span, 7..10);
    assert!(
        err.to_string().starts_with("in the queue's DEFAULT_EXTSCHED: at byte 7 (\"BAD\")"),
        "{err}"
    );
    let err = merge_extsched(Some("CPUSET[MAX_RADIUS=x]"), None, None).expect_err("bad mandatory");
    assert_eq!(err.source_string, ExtschedSource::QueueMandatory);
    let err = merge_extsched(None, Some("affinity[core(0)]"), None).expect_err("bad job");
    assert_eq!(err.source_string, ExtschedSource::Job);
    assert!(err.render("affinity[core(0)]").contains("\n              ^\n"));
}

// ---------------------------------------------------------------------------------------------
// Properties

fn level() -> impl Strategy<Value = Level> {
    prop_oneof![
        Just(Level::Thread),
        Just(Level::Core),
        Just(Level::L3),
        Just(Level::Numa),
        Just(Level::Socket)
    ]
}

fn scope() -> impl Strategy<Value = Scope> {
    prop_oneof![Just(Scope::InTask), Just(Scope::InJob), Just(Scope::AllJobs)]
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![3 => 1u32..=8, 1 => 1u32..=MAX_COUNT]
}

fn distribute() -> impl Strategy<Value = Distribute> {
    prop_oneof![
        Just(Distribute::Any),
        Just(Distribute::Balance),
        Just(Distribute::Pack(None)),
        (level(), count()).prop_map(|(l, n)| Distribute::Pack(Some((l, n)))),
    ]
}

fn mem() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..=4096, (1u64..=4096).prop_map(|g| g << 10), 1u64..=MAX_MEM_MIB]
}

fn gpubind() -> impl Strategy<Value = GpuBind> {
    prop_oneof![Just(GpuBind::Numa), Just(GpuBind::Socket), Just(GpuBind::Any)]
}

fn affinity_request() -> impl Strategy<Value = Request> {
    (
        (level(), prop::option::of(count()), count(), prop::option::of(level())),
        prop::option::of((level(), scope())),
        prop::option::of(level()),
        any::<bool>(),
        distribute(),
        (prop::option::of(mem()), prop::option::of(gpubind()), prop::option::of(count())),
        prop::option::of(1u32..=1000),
    )
        .prop_map(
            |(
                (unit, tasks, units_per_task, same),
                ex,
                cpubind,
                local,
                distribute,
                (mem_mib, gpubind, gpus_per_task),
                more,
            )| {
                let tasks_max =
                    tasks.zip(more).map(|(t, m)| t.saturating_add(m)).filter(|&m| m <= MAX_COUNT);
                // GPUs do not resize: a task range takes no gpus=.
                let gpus_per_task = gpus_per_task.filter(|_| tasks_max.is_none());
                Request {
                    tasks,
                    tasks_max,
                    unit,
                    units_per_task,
                    same: same.map(|l| l.max(unit)),
                    exclusive: ex.map(|(l, scope)| Exclusive { level: l.max(unit), scope }),
                    cpubind,
                    membind: if local { MemBind::LocalOnly } else { MemBind::LocalPrefer },
                    distribute,
                    mem_mib,
                    gpubind,
                    gpus_per_task,
                    ..Request::default()
                }
            },
        )
}

const ALL_OPTIONS: [CpusetOption; 8] = [
    CpusetOption::CpuExclusive,
    CpusetOption::MemoryLocal,
    CpusetOption::MemoryExclusive,
    CpusetOption::MemoryKernelAvoid,
    CpusetOption::MemoryMandatory,
    CpusetOption::PolicyPage,
    CpusetOption::PolicyKill,
    CpusetOption::EventNotify,
];

fn cpuset_request() -> impl Strategy<Value = Request> {
    let cpuset_type = prop::option::of(prop_oneof![
        Just(CpusetType::Static),
        Just(CpusetType::Dynamic),
        Just(CpusetType::None)
    ]);
    let name = prop::option::of(
        "[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}".prop_filter("valid name", |n| check_name(n).is_ok()),
    );
    let cpus = prop::option::of(prop::collection::vec(
        prop_oneof![0u32..=64, 0u32..=crate::cpuset::MAX_CPU_ID],
        1..12,
    ));
    let options = prop::collection::vec(any::<bool>(), 8);
    let numbers = (prop::option::of(0u32..=MAX_COUNT), prop::option::of(count()), any::<bool>());
    (cpuset_type, name, cpus, options, numbers).prop_map(
        |(cpuset_type, cpuset_name, cpus, options, numbers)| {
            let (max_radius, max_cpu_per_node, resume) = numbers;
            Request {
                cpuset_type,
                cpuset_name,
                cpu_list: cpus.map(|c| c.into_iter().collect()),
                cpuset_options: ALL_OPTIONS
                    .iter()
                    .zip(options)
                    .filter(|(_, on)| *on)
                    .map(|(o, _)| *o)
                    .collect(),
                max_radius,
                max_cpu_per_node,
                resume_option: resume.then_some(ResumeOption::OrigCpus),
                ..Request::default()
            }
        },
    )
}

/// Random valid requests: affinity fields, `CPUSET` fields, or both.
fn valid_request() -> impl Strategy<Value = Request> {
    (affinity_request(), cpuset_request(), 0..3u8).prop_map(|(a, c, which)| match which {
        0 => a,
        1 => c,
        _ => Request {
            cpuset_type: c.cpuset_type,
            cpuset_name: c.cpuset_name,
            cpu_list: c.cpu_list,
            cpuset_options: c.cpuset_options,
            max_radius: c.max_radius,
            max_cpu_per_node: c.max_cpu_per_node,
            resume_option: c.resume_option,
            ..a
        },
    })
}

/// What must hold for any input: no panic (the caller got here), an error span inside the input
/// on character boundaries with the fragment it names, and a result that validates and
/// round-trips.
fn check_parse(input: &str) -> Result<(), String> {
    match parse(input) {
        Ok(r) => {
            r.validate().map_err(|why| format!("{input:?} parsed to an invalid request: {why}"))?;
            let text = r.to_string();
            match parse(&text) {
                Ok(again) if again == r => Ok(()),
                other => Err(format!("{input:?} -> {text:?} -> {other:?}")),
            }
        }
        Err(err) => check_span(input, &err),
    }
}

fn check_span(input: &str, err: &RequestError) -> Result<(), String> {
    let ok = err.span.start <= err.span.end
        && err.span.end <= input.len()
        && input.is_char_boundary(err.span.start)
        && input.is_char_boundary(err.span.end)
        && input.get(err.span.clone()) == Some(err.fragment.as_str())
        && !err.message.is_empty();
    let _ = err.render(input);
    if ok {
        Ok(())
    } else {
        Err(format!("bad error span for {input:?}: {err:?}"))
    }
}

fn check_merge(m: &str, j: &str, d: &str) -> Result<(), String> {
    match merge_extsched(Some(m), Some(j), Some(d)) {
        Ok(r) => r.validate().map_err(|why| format!("merge gave an invalid request: {why}")),
        Err(err) => {
            let input = match err.source_string {
                ExtschedSource::QueueMandatory => m,
                ExtschedSource::Job => j,
                ExtschedSource::QueueDefault => d,
            };
            check_span(input, &err.error)
        }
    }
}

/// Pieces of the grammar, for random inputs that get deep into the parser.
const PIECES: &[&str] = &[
    "CPUSET",
    "affinity",
    "[",
    "]",
    "(",
    ")",
    ":",
    ";",
    ",",
    "=",
    "*",
    " ",
    "|",
    "core",
    "numa",
    "socket",
    "thread",
    "l3",
    "mcm",
    "cpu",
    "same",
    "exclusive",
    "injob",
    "alljobs",
    "intask",
    "cpubind",
    "membind",
    "localonly",
    "distribute",
    "pack",
    "balance",
    "any",
    "mem",
    "4G",
    "2",
    "0",
    "65536",
    "99999999999999999999",
    "CPU_LIST",
    "MAX_RADIUS",
    "CPUSET_OPTIONS",
    "CPUSET_CPU_EXCLUSIVE",
    "CPUSET_NAME",
    "CPUSET_TYPE",
    "dynamic",
    "1-3",
    "1, 5",
    "ö",
    "€",
    "\u{0}",
    "\t",
    "..",
    "/",
];
const INSERTS: &[u8] = b"[]():;,=*";

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Delete(usize),
}

fn mutate(text: &str, muts: &[Mutation]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for m in muts {
        let n = bytes.len().max(1);
        match *m {
            Mutation::Flip(i, bit) => {
                if let Some(b) = bytes.get_mut(i % n) {
                    *b ^= 1 << (bit % 8);
                }
            }
            Mutation::Truncate(i) => bytes.truncate(i % (n + 1)),
            Mutation::Insert(i, c) => {
                bytes.insert(i % (bytes.len() + 1), INSERTS[usize::from(c) % INSERTS.len()])
            }
            Mutation::Delete(i) => {
                if !bytes.is_empty() {
                    bytes.remove(i % n);
                }
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, c)| Mutation::Insert(i, c)),
        any::<usize>().prop_map(Mutation::Delete),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn valid_requests_round_trip(r in valid_request()) {
        prop_assert_eq!(r.validate(), Ok(()));
        let text = r.to_string();
        prop_assert_eq!(parse(&text), Ok(r), "text {}", text);
    }

    /// A position a (possibly hostile) topod sent, over any text: a caret line, never a panic.
    #[test]
    fn a_caret_anywhere_in_any_text_never_panics(s in "\\PC{0,300}", a in 0usize..1200, b in 0usize..1200) {
        let shown = crate::request::caret(&s, a..b);
        // Two lines whatever the text holds (a newline in it is shown as a space), and at
        // least one caret.
        prop_assert_eq!(shown.split('\n').count(), 2, "{:?}", shown);
        prop_assert!(shown.ends_with('^'), "{:?}", shown);
    }

    #[test]
    fn random_strings_never_panic(s in "\\PC{0,60}") {
        check_parse(&s).map_err(TestCaseError::fail)?;
        check_merge(&s, "affinity[core]", "CPUSET[MAX_RADIUS=]").map_err(TestCaseError::fail)?;
    }

    #[test]
    fn grammar_soup_never_panics(pieces in prop::collection::vec(prop::sample::select(PIECES), 0..24)) {
        let s = pieces.concat();
        check_parse(&s).map_err(TestCaseError::fail)?;
        check_merge("CPUSET[CPU_LIST=]", &s, &s).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn mutated_requests_never_panic(r in valid_request(), muts in prop::collection::vec(mutation(), 1..4)) {
        let s = mutate(&r.to_string(), &muts);
        check_parse(&s).map_err(TestCaseError::fail)?;
        check_merge(&s, &s, "CPUSET[MAX_CPU_PER_NODE=2]").map_err(TestCaseError::fail)?;
    }
}

// ---------------------------------------------------------------------------------------------
// The long fuzz run

/// xorshift64*: a small seeded generator, so the long run needs no dependency and is repeatable.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

const LEVELS: [Level; 5] = [Level::Thread, Level::Core, Level::L3, Level::Numa, Level::Socket];

fn random_count(rng: &mut XorShift) -> u32 {
    if rng.chance(4) {
        1 + rng.below(u64::from(MAX_COUNT)) as u32
    } else {
        1 + rng.below(8) as u32
    }
}

fn random_request(rng: &mut XorShift) -> Request {
    let mut r = Request::default();
    if !rng.chance(3) {
        r.unit = rng.pick(&LEVELS);
        r.units_per_task = random_count(rng);
        r.tasks = rng.chance(2).then(|| random_count(rng));
        r.same = rng.chance(2).then(|| rng.pick(&LEVELS).max(r.unit));
        let scope = rng.pick(&[Scope::InTask, Scope::InJob, Scope::AllJobs]);
        r.exclusive =
            rng.chance(2).then(|| Exclusive { level: rng.pick(&LEVELS).max(r.unit), scope });
        r.cpubind = rng.chance(2).then(|| rng.pick(&LEVELS));
        r.membind = if rng.chance(2) { MemBind::LocalOnly } else { MemBind::LocalPrefer };
        r.distribute = match rng.below(4) {
            0 => Distribute::Any,
            1 => Distribute::Balance,
            2 => Distribute::Pack(None),
            _ => Distribute::Pack(Some((rng.pick(&LEVELS), random_count(rng)))),
        };
        r.mem_mib = rng.chance(3).then(|| 1 + rng.below(MAX_MEM_MIB));
        r.gpubind =
            rng.chance(3).then(|| rng.pick(&[GpuBind::Numa, GpuBind::Socket, GpuBind::Any]));
        r.gpus_per_task = rng.chance(3).then(|| random_count(rng));
    }
    if rng.chance(2) {
        r.cpuset_type = rng
            .chance(2)
            .then(|| rng.pick(&[CpusetType::Static, CpusetType::Dynamic, CpusetType::None]));
        r.cpuset_name = rng.chance(3).then(|| format!("set{}", rng.below(1000)));
        r.cpu_list =
            rng.chance(2).then(|| (0..1 + rng.below(6)).map(|_| rng.below(200) as u32).collect());
        r.cpuset_options = ALL_OPTIONS.iter().copied().filter(|_| rng.chance(4)).collect();
        r.max_radius = rng.chance(2).then(|| rng.below(5) as u32);
        r.max_cpu_per_node = rng.chance(2).then(|| random_count(rng));
        r.resume_option = rng.chance(4).then_some(ResumeOption::OrigCpus);
    }
    r
}

fn random_input(rng: &mut XorShift) -> String {
    match rng.below(3) {
        0 => {
            let n = rng.below(40);
            (0..n)
                .map(|_| match rng.below(8) {
                    0 => char::from_u32(rng.below(0x11_0000) as u32).unwrap_or('?'),
                    1 => char::from(rng.below(128) as u8),
                    _ => char::from(rng.pick(b"[]():;,=* aCcoremnu0129_|-")),
                })
                .collect()
        }
        1 => (0..rng.below(24)).map(|_| rng.pick(PIECES)).collect(),
        _ => {
            let muts: Vec<Mutation> = (0..1 + rng.below(3))
                .map(|_| {
                    let (i, b) = (rng.next() as usize, rng.next() as u8);
                    match rng.below(4) {
                        0 => Mutation::Flip(i, b),
                        1 => Mutation::Truncate(i),
                        2 => Mutation::Insert(i, b),
                        _ => Mutation::Delete(i),
                    }
                })
                .collect();
            mutate(&random_request(rng).to_string(), &muts)
        }
    }
}

/// Long fuzz: 1,000,000 random and mutated inputs through `parse` (and every 10th through
/// `merge_extsched`), plus a round trip of 100,000 random valid requests. Run it with
/// `cargo test --release -- --ignored request_fuzz_million`.
#[test]
#[ignore = "long: cargo test --release -- --ignored request_fuzz_million"]
fn request_fuzz_million() {
    let started = std::time::Instant::now();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for i in 0..1_000_000u32 {
        let s = random_input(&mut rng);
        if let Err(why) = check_parse(&s) {
            panic!("case {i}: {why}");
        }
        if i % 10 == 0 {
            let other = random_input(&mut rng);
            if let Err(why) = check_merge(&other, &s, "CPUSET[MAX_RADIUS=;CPU_LIST=0-7]") {
                panic!("case {i} (merge): {why}");
            }
        }
    }
    for i in 0..100_000u32 {
        let r = random_request(&mut rng);
        assert_eq!(r.validate(), Ok(()), "case {i}: {r:?}");
        let text = r.to_string();
        assert_eq!(parse(&text).as_ref(), Ok(&r), "case {i}: {text:?}");
    }
    eprintln!("request_fuzz_million: {:?}", started.elapsed());
}
