//! The published protocol schema (`packaging/protocol.schema.json`, which the PBS hook reads
//! replies against) is exactly what this build's types generate.

#[test]
fn the_published_protocol_schema_is_what_the_types_generate() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/protocol.schema.json");
    let published: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read the published schema"))
            .expect("the published schema is JSON");
    let generated = topo_core::proto::schema::document();
    assert!(
        published == generated,
        "{path} differs from what the protocol's types generate; run\n  cargo run -p topod --bin topoctl -- protocol-schema > packaging/protocol.schema.json"
    );
}

#[test]
fn every_operation_has_a_reply_in_the_schema() {
    let document = topo_core::proto::schema::document();
    for op in topo_core::proto::OPERATIONS {
        assert!(document["$defs"].get(format!("ok.{op}")).is_some(), "no reply schema for {op}");
    }
    // Replies a real topod sends (typed on its side) fit the schema's reply shapes.
    let allocation = serde_json::to_value(topo_core::ledger::Allocation {
        job: "1".into(),
        cpus: topo_core::CpuSet::parse_list("0-3").unwrap(),
        tasks: vec![topo_core::CpuSet::parse_list("0-3").unwrap()],
        mems: topo_core::CpuSet::parse_list("0").unwrap(),
        fenced: topo_core::CpuSet::new(),
        request: "affinity[core(4)]".into(),
        gang_row: None,
    })
    .unwrap();
    let required = document["$defs"]["Allocation"]["required"].as_array().unwrap();
    for field in required {
        assert!(allocation.get(field.as_str().unwrap()).is_some(), "{field} missing");
    }
}
