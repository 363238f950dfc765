//! vLLM's chat-template content format: whether a template is given each message's content as
//! one string or as a list of parts, detected from the template's syntax tree exactly as vLLM
//! 0.32.0 does (`vllm/renderers/hf.py`, `_detect_content_format` and the `_iter_nodes_*`
//! helpers), or stated (`--chat-template-content-format`, vLLM's flag of the same name).
//!
//! vLLM's rule: a template that loops over a message's `content` (`{% for part in
//! message['content'] %}`, through any variable assigned from `messages` or looped over it, a
//! macro parameter given `message.content`, or a top-level loop over a variable named `content`)
//! is `openai`; any other is `string`; a template that does not parse, or whose tree trips one of
//! vLLM's assertions before a content loop is found (a tuple loop target over `messages`, say),
//! is `string`.

use std::collections::{HashMap, HashSet};

use minijinja::machinery::ast::{CallArg, Expr, ForLoop, Macro, Set, Stmt};
use minijinja::machinery::parse;
use minijinja::syntax::SyntaxConfig;
use serde::{Deserialize, Serialize};

/// How message contents are given to the chat template (vLLM's `--chat-template-content-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum ContentFormatOption {
    /// Detected from the template as vLLM detects it (vLLM's default).
    #[default]
    Auto,
    /// Each message's content is one string (text parts joined with newlines).
    String,
    /// Each message's content is a list of parts (`{"type": "text", "text": ...}`), a plain
    /// string content included.
    Openai,
    /// Not vLLM's: the request's messages as sent, given to the template as transformers'
    /// `apply_chat_template` is given them (no part joined or wrapped, no field dropped, tool
    /// arguments as sent); SGLang leaves a string content as it is in either format.
    AsSent,
}

/// The content format a template is rendered with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    String,
    Openai,
}

impl ContentFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ContentFormat::String => "string",
            ContentFormat::Openai => "openai",
        }
    }
}

impl ContentFormatOption {
    pub fn as_str(self) -> &'static str {
        match self {
            ContentFormatOption::Auto => "auto",
            ContentFormatOption::String => "string",
            ContentFormatOption::Openai => "openai",
            ContentFormatOption::AsSent => "as_sent",
        }
    }

    /// The format a template with `source` is rendered with under this option (`None`: as sent).
    pub(crate) fn resolve(self, source: &str) -> Option<ContentFormat> {
        match self {
            ContentFormatOption::Auto => Some(detect(source)),
            ContentFormatOption::String => Some(ContentFormat::String),
            ContentFormatOption::Openai => Some(ContentFormat::Openai),
            ContentFormatOption::AsSent => None,
        }
    }
}

/// vLLM's `_detect_content_format(source, default="string")`.
pub(crate) fn detect(source: &str) -> ContentFormat {
    let Ok(tree) = parse(source, "<chat template>", SyntaxConfig::default()) else {
        return ContentFormat::String;
    };
    let mut nodes = Nodes::default();
    nodes.stmt(&tree, None);
    match nodes.loops_over_content() {
        Ok(true) => ContentFormat::Openai,
        // No content loop, or one of vLLM's assertions failed first (its `except Exception`).
        Ok(false) | Err(()) => ContentFormat::String,
    }
}

/// The nodes vLLM's detection looks at, in the order `jinja2.nodes.Node.find_all` yields them
/// (depth first, in source order).
#[derive(Default)]
struct Nodes<'t, 'a> {
    sets: Vec<&'t Set<'a>>,
    /// Each loop with the macros it lies in (innermost last).
    loops: Vec<(&'t ForLoop<'a>, Vec<usize>)>,
    macros: Vec<&'t Macro<'a>>,
    calls: Vec<NamedCall<'t, 'a>>,
}

/// A call by name: the callee, its positional arguments and its keyword arguments.
type NamedCall<'t, 'a> = (&'a str, Vec<&'t Expr<'a>>, Vec<(&'a str, &'t Expr<'a>)>);

impl<'t, 'a> Nodes<'t, 'a> {
    fn stmt(&mut self, stmt: &'t Stmt<'a>, in_macro: Option<&[usize]>) {
        let macros = in_macro.unwrap_or(&[]);
        let body = |nodes: &mut Self, stmts: &'t [Stmt<'a>], macros: &[usize]| {
            for stmt in stmts {
                nodes.stmt(stmt, Some(macros));
            }
        };
        match stmt {
            Stmt::Template(template) => body(self, &template.children, macros),
            Stmt::EmitExpr(emit) => self.expr(&emit.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(for_loop) => {
                self.loops.push((for_loop, macros.to_vec()));
                self.expr(&for_loop.target);
                self.expr(&for_loop.iter);
                if let Some(filter) = &for_loop.filter_expr {
                    self.expr(filter);
                }
                body(self, &for_loop.body, macros);
                body(self, &for_loop.else_body, macros);
            }
            Stmt::IfCond(cond) => {
                self.expr(&cond.expr);
                body(self, &cond.true_body, macros);
                body(self, &cond.false_body, macros);
            }
            Stmt::WithBlock(with) => {
                for (target, value) in &with.assignments {
                    self.expr(target);
                    self.expr(value);
                }
                body(self, &with.body, macros);
            }
            Stmt::Set(set) => {
                self.sets.push(set);
                self.expr(&set.target);
                self.expr(&set.expr);
            }
            Stmt::SetBlock(set) => {
                self.expr(&set.target);
                if let Some(filter) = &set.filter {
                    self.expr(filter);
                }
                body(self, &set.body, macros);
            }
            Stmt::AutoEscape(block) => {
                self.expr(&block.enabled);
                body(self, &block.body, macros);
            }
            Stmt::FilterBlock(block) => {
                self.expr(&block.filter);
                body(self, &block.body, macros);
            }
            Stmt::Block(block) => body(self, &block.body, macros),
            Stmt::Import(import) => {
                self.expr(&import.expr);
                self.expr(&import.name);
            }
            Stmt::FromImport(import) => {
                self.expr(&import.expr);
                for (name, alias) in &import.names {
                    self.expr(name);
                    if let Some(alias) = alias {
                        self.expr(alias);
                    }
                }
            }
            Stmt::Extends(extends) => self.expr(&extends.name),
            Stmt::Include(include) => self.expr(&include.name),
            Stmt::Macro(macro_decl) => {
                self.macros.push(macro_decl);
                let inside: Vec<usize> = macros.iter().copied().chain([self.macros.len() - 1]).collect();
                for arg in macro_decl.args.iter().chain(&macro_decl.defaults) {
                    self.expr(arg);
                }
                body(self, &macro_decl.body, &inside);
            }
            Stmt::CallBlock(block) => {
                self.call(&block.call.expr, &block.call.args);
                // Jinja's CallBlock is no Macro: its body's loops are not in a macro of their own.
                for arg in block.macro_decl.args.iter().chain(&block.macro_decl.defaults) {
                    self.expr(arg);
                }
                body(self, &block.macro_decl.body, macros);
            }
            Stmt::Do(call) => self.call(&call.call.expr, &call.call.args),
        }
    }

    fn call(&mut self, callee: &'t Expr<'a>, args: &'t [CallArg<'a>]) {
        if let Expr::Var(var) = callee {
            let positional = args
                .iter()
                .filter_map(|arg| match arg {
                    CallArg::Pos(expr) => Some(expr),
                    _ => None,
                })
                .collect();
            let keywords = args
                .iter()
                .filter_map(|arg| match arg {
                    CallArg::Kwarg(name, expr) => Some((*name, expr)),
                    _ => None,
                })
                .collect();
            self.calls.push((var.id, positional, keywords));
        }
        self.expr(callee);
        self.args(args);
    }

    fn args(&mut self, args: &'t [CallArg<'a>]) {
        for arg in args {
            match arg {
                CallArg::Pos(expr)
                | CallArg::Kwarg(_, expr)
                | CallArg::PosSplat(expr)
                | CallArg::KwargSplat(expr) => self.expr(expr),
            }
        }
    }

    fn expr(&mut self, expr: &'t Expr<'a>) {
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(slice) => {
                self.expr(&slice.expr);
                for bound in [&slice.start, &slice.stop, &slice.step].into_iter().flatten() {
                    self.expr(bound);
                }
            }
            Expr::UnaryOp(op) => self.expr(&op.expr),
            Expr::BinOp(op) => {
                self.expr(&op.left);
                self.expr(&op.right);
            }
            Expr::Compare(compare) => {
                self.expr(&compare.expr);
                for op in &compare.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(if_expr) => {
                self.expr(&if_expr.test_expr);
                self.expr(&if_expr.true_expr);
                if let Some(false_expr) = &if_expr.false_expr {
                    self.expr(false_expr);
                }
            }
            Expr::Filter(filter) => {
                if let Some(inner) = &filter.expr {
                    self.expr(inner);
                }
                self.args(&filter.args);
            }
            Expr::Test(test) => {
                self.expr(&test.expr);
                self.args(&test.args);
            }
            Expr::GetAttr(get) => self.expr(&get.expr),
            Expr::GetItem(get) => {
                self.expr(&get.expr);
                self.expr(&get.subscript_expr);
            }
            Expr::Call(call) => self.call(&call.expr, &call.args),
            Expr::List(list) => list.items.iter().for_each(|item| self.expr(item)),
            Expr::Tuple(tuple) => tuple.items.iter().for_each(|item| self.expr(item)),
            Expr::Map(map) => map.keys.iter().chain(&map.values).for_each(|item| self.expr(item)),
        }
    }

    /// `_iter_nodes_assign_content_item` yields anything: `Err` where vLLM's assertions fail first.
    fn loops_over_content(&self) -> Result<bool, ()> {
        let message_vars = self.message_vars()?;
        // Macro parameters given a message's content, per loop inside the macro.
        let mut params_by_loop: HashMap<usize, HashSet<&str>> = HashMap::new();
        for (macro_index, macro_decl) in self.macros.iter().enumerate() {
            let params: Vec<&str> = macro_decl.args.iter().filter_map(var_name).collect();
            let mut content_params = HashSet::new();
            for (callee, positional, keywords) in &self.calls {
                if *callee != macro_decl.name {
                    continue;
                }
                for (position, arg) in positional.iter().enumerate() {
                    let is_content =
                        message_vars.iter().any(|var| is_var_or_elems(arg, var, Some("content")));
                    if position < params.len() && is_content {
                        content_params.insert(params[position]);
                    }
                }
                for (key, value) in keywords {
                    let is_content =
                        message_vars.iter().any(|var| is_var_or_elems(value, var, Some("content")));
                    if params.contains(key) && is_content {
                        content_params.insert(*key);
                    }
                }
            }
            if !content_params.is_empty() {
                for (loop_index, (_, macros)) in self.loops.iter().enumerate() {
                    if macros.contains(&macro_index) {
                        params_by_loop.insert(loop_index, content_params.clone());
                    }
                }
            }
        }
        for (loop_index, (for_loop, macros)) in self.loops.iter().enumerate() {
            let over_content =
                if message_vars.iter().any(|var| is_var_or_elems(&for_loop.iter, var, Some("content"))) {
                    true
                } else {
                    let iter_name = match &for_loop.iter {
                        Expr::Var(var) => Some(var.id),
                        _ => None,
                    };
                    let in_content_param = params_by_loop
                        .get(&loop_index)
                        .is_some_and(|params| iter_name.is_some_and(|name| params.contains(name)));
                    in_content_param || (macros.is_empty() && iter_name == Some("content"))
                };
            if over_content {
                // vLLM asserts the loop's target is a plain name.
                return var_name(&for_loop.target).map(|_| true).ok_or(());
            }
        }
        Ok(false)
    }

    /// Names bound to one message: the targets of loops over `messages` or a variable assigned
    /// from it (`_iter_nodes_assign_messages_item`).
    fn message_vars(&self) -> Result<Vec<&'a str>, ()> {
        let messages_vars = self.messages_vars()?;
        let mut names = Vec::new();
        for (for_loop, _) in &self.loops {
            if messages_vars.iter().any(|var| is_var_or_elems(&for_loop.iter, var, None)) {
                names.push(var_name(&for_loop.target).ok_or(())?);
            }
        }
        Ok(names)
    }

    /// `messages` and every variable assigned from it, transitively (`_iter_nodes_assign_var_or_elems`).
    fn messages_vars(&self) -> Result<Vec<&'a str>, ()> {
        let mut names = vec!["messages"];
        let mut pending = std::collections::VecDeque::from(["messages"]);
        while let Some(related) = pending.pop_front() {
            for set in &self.sets {
                if is_var_or_elems(&set.expr, related, None) {
                    let name = var_name(&set.target).ok_or(())?;
                    // vLLM follows a chain of assignments without end on a cycle; once is enough.
                    if !names.contains(&name) {
                        names.push(name);
                        pending.push_back(name);
                    }
                }
            }
        }
        Ok(names)
    }
}

fn var_name<'a>(expr: &Expr<'a>) -> Option<&'a str> {
    match expr {
        Expr::Var(var) => Some(var.id),
        _ => None,
    }
}

/// `_is_var_or_elems_access`: `name`, or `name[key]` / `name.key` with `key`, through filters,
/// tests and slices.
fn is_var_or_elems(expr: &Expr<'_>, name: &str, key: Option<&str>) -> bool {
    match expr {
        Expr::Filter(filter) => filter.expr.as_ref().is_some_and(|inner| is_var_or_elems(inner, name, key)),
        Expr::Test(test) => is_var_or_elems(&test.expr, name, key),
        Expr::Slice(slice) => is_var_or_elems(&slice.expr, name, key),
        _ => match key {
            Some(key) => is_attr_access(expr, name, key),
            None => var_name(expr) == Some(name),
        },
    }
}

/// `_is_attr_access`: `name[key]` (a constant key) or `name.key`.
fn is_attr_access(expr: &Expr<'_>, name: &str, key: &str) -> bool {
    match expr {
        Expr::GetItem(get) => {
            var_name(&get.expr) == Some(name)
                && matches!(&get.subscript_expr, Expr::Const(constant) if constant.value.as_str() == Some(key))
        }
        Expr::GetAttr(get) => var_name(&get.expr) == Some(name) && get.name == key,
        _ => false,
    }
}

#[cfg(test)]
mod tests;
