//! The demo image's command lines (the compose stack's load generators, the Dockerfile's
//! default) parse as `kvindex-tools` reads them.

use kvindex_tools::deploy::compose_commands;
use std::process::Command;

fn read(path: &str) -> String {
    let full = format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

#[test]
fn every_command_line_of_the_demo_image_parses() {
    let mut lines = compose_commands(&read("docker-compose.yml"), "kvindex-demo:latest");
    let services: Vec<&str> = lines.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(services, ["loadgen", "loadgen-sharded"], "demo services of docker-compose.yml");
    let dockerfile = read("Dockerfile");
    let demo = &dockerfile[dockerfile.find("AS demo").expect("the demo stage")..];
    let cmd = demo.lines().find(|l| l.starts_with("CMD")).expect("the demo stage's CMD");
    lines.push(("Dockerfile demo CMD".into(), serde_json::from_str(&cmd[cmd.find('[').expect("exec form")..]).expect("JSON")));
    for (what, args) in &lines {
        let out = Command::new(env!("CARGO_BIN_EXE_kvindex-tools")).args(args).arg("--check-args").output().expect("runs");
        assert!(
            out.status.success(),
            "{what}: `kvindex-tools {}` does not parse: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let typo = Command::new(env!("CARGO_BIN_EXE_kvindex-tools")).args(["demo", "--sped", "2", "--check-args"]).output().unwrap();
    assert!(!typo.status.success(), "a typo is caught");
}
